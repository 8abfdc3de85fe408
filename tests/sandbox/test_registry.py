"""The named registry of backends: gVisor unless unsafe_local is asked for by name."""

import pytest

from cloche.errors import ConfigError
from cloche.sandbox.gvisor import GVisorBackend
from cloche.sandbox.registry import BACKENDS, create_backend
from cloche.sandbox.unsafe_local import UnsafeLocalBackend
from support import make_config


def test_auto_is_gvisor_and_unsafe_local_only_by_name():
    assert BACKENDS["auto"] is GVisorBackend
    assert BACKENDS["gvisor"] is GVisorBackend
    assert {name for name, cls in BACKENDS.items() if cls is UnsafeLocalBackend} == {
        "unsafe-local",
        "unsafe_local",
    }


def test_an_unknown_backend_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="unknown backend 'docker'; choose one of auto, gvisor"):
        create_backend(make_config(tmp_path, backend="docker"))


def test_the_named_backend_is_made(tmp_path):
    assert isinstance(
        create_backend(make_config(tmp_path, backend="unsafe-local")), UnsafeLocalBackend
    )
