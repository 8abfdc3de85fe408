"""Ray's token authentication, as cloche uses it: who may connect to the cluster at all.

Whoever reaches a Ray cluster's ports can run any code on its machines (as the user Ray runs
as: root, where sandboxes are made). So cloche starts its own clusters (local:N) with
`RAY_AUTH_MODE=token` and a token it makes for each, and refuses to join one that lets a
caller without a token in, unless told --cluster-insecure.

Ray reads its settings from the environment (of this process and of every process it
starts) and caches the token in its C++ core: `use` sets both and `forget` undoes them.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from cloche.errors import ConfigError

# The names of Ray's settings (environment variables), not secrets.
MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"  # noqa: S105
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"  # noqa: S105
_NAMES = (MODE, TOKEN, TOKEN_PATH)
PROBE_TIMEOUT_S = 30.0

HOW_TO_GIVE = (
    f"give cloche the cluster's token with {MODE}=token and {TOKEN}=<token> or "
    f"{TOKEN_PATH}=<file> in its environment"
)

# Run in a clean process: asks the GCS one question without any token. Prints "open" when
# answered, "refused" when Ray says the token is missing, else the error.
_PROBE = """
import sys
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", None, timeout=10)
except AuthenticationError:
    print("refused")
except Exception as exc:
    print(f"error {type(exc).__name__}: {exc}")
else:
    print("open")
"""


class ClusterToken:
    """A token made for one local cluster: a 0600 file under the state dir, given to Ray's
    processes (and this one) through RAY_AUTH_TOKEN_PATH; never logged."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / f"ray-token-{secrets.token_hex(4)}"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_urlsafe(32))
        self._saved: dict[str, str | None] = {}

    def use(self) -> None:
        """From now on this process and those it starts speak to Ray with this token."""
        self._saved = {name: os.environ.get(name) for name in _NAMES}
        os.environ[MODE] = "token"
        os.environ[TOKEN_PATH] = str(self.path)
        os.environ.pop(TOKEN, None)
        _reload()

    def forget(self) -> None:
        """Undo `use` and remove the file (after the cluster's processes are gone)."""
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self._saved:
            _reload()
        self._saved = {}
        self.path.unlink(missing_ok=True)


def _reload() -> None:
    """Ray's core caches its settings and the token: read them again (config first, so that
    none of its threads reloads a token while the old mode still stands)."""
    import ray._raylet as core

    core.Config.initialize("")  # type: ignore[attr-defined]
    core.AuthenticationTokenLoader.instance().reset_cache()  # type: ignore[attr-defined]


def requires_token(gcs_address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the Ray cluster whose GCS is at gcs_address turns away a caller without a
    token: asked by a clean process with no token of any kind (blocking, ~0.5 s).

    Raises:
        ConfigError: the GCS didn't answer either way.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env[MODE] = "disabled"  # so no token is sent, not even ~/.ray/auth_token
    return _ask(gcs_address, env, timeout_s) == "refused"


def check_token(gcs_address: str) -> None:
    """Raises ConfigError, naming what to give, unless the cluster at gcs_address takes the
    token this process was given (asked as Ray would: ray.init itself retries for ~20 s)."""
    if _ask(gcs_address, dict(os.environ), PROBE_TIMEOUT_S) == "refused":
        given = os.environ.get(MODE, "") == "token"
        raise ConfigError(
            f"the Ray cluster at {gcs_address} requires a token "
            + (
                "and does not take the one cloche was given: "
                if given
                else "cloche was not given: "
            )
            + HOW_TO_GIVE
        )


def _ask(gcs_address: str, env: dict[str, str], timeout_s: float) -> str:
    """ "open" or "refused": what the GCS answers a process with this environment."""
    try:
        found = subprocess.run(
            [sys.executable, "-c", _PROBE, gcs_address],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"the Ray cluster at {gcs_address} did not answer in time") from exc
    answer = (found.stdout.strip().splitlines() or [""])[-1]
    if answer in ("open", "refused"):
        return answer
    raise ConfigError(
        f"can't tell whether the Ray cluster at {gcs_address} requires a token: "
        f"{answer or found.stderr.strip()[-500:]}"
    )


def refuse_open_cluster(address: str) -> ConfigError:
    """The error for a cluster that lets anyone in."""
    return ConfigError(
        f"the Ray cluster at {address} does not enforce token authentication: anyone who "
        "can reach its ports can run code on its machines. Start its nodes with "
        f"{MODE}=token (make a token with `ray get-auth-token --generate`), and "
        f"{HOW_TO_GIVE}; or pass --cluster-insecure to join it anyway"
    )
