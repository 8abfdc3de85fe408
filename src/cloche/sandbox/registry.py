"""The named registry of sandbox backends: `"auto"` is gVisor; unsafe_local is opt-in only."""

from __future__ import annotations

from cloche.config import ServerConfig
from cloche.errors import ConfigError
from cloche.sandbox.base import Backend
from cloche.sandbox.gvisor import GVisorBackend
from cloche.sandbox.unsafe_local import UnsafeLocalBackend

BACKENDS: dict[str, type[Backend]] = {
    "auto": GVisorBackend,
    "gvisor": GVisorBackend,
    "unsafe-local": UnsafeLocalBackend,
    "unsafe_local": UnsafeLocalBackend,
}
_SHOWN = ("auto", "gvisor", "unsafe-local")  # the names error messages offer


def create_backend(config: ServerConfig) -> Backend:
    """The backend named by config.backend.

    Raises:
        ConfigError: no backend of that name.
    """
    try:
        backend_class = BACKENDS[config.backend]
    except KeyError:
        names = ", ".join(_SHOWN)
        raise ConfigError(f"unknown backend {config.backend!r}; choose one of {names}") from None
    return backend_class(config)
