"""E2B's network options onto cloche's egress, within the server's ceiling (its policies):
the default policy for `allow_internet_access`, narrowed by `allow_out`, nothing for
`allow_internet_access=False`, and a 403 naming a rule wider than the ceiling."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import SandboxException
from e2b_code_interpreter import Sandbox

from support import ServerThread, make_config, require_gvisor

pytestmark = [pytest.mark.gvisor]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_gvisor()
    root = tmp_path_factory.mktemp("e2b-egress")
    policy = root / "egress.toml"
    policy.write_text('[policies.default]\nallow = ["example.com:443", "*.pypi.org:443"]\n')
    config = make_config(Path(root / "state"), egress_policy=policy)
    with ServerThread(config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
        os.environ.update(
            E2B_API_URL=f"{base}/e2b", E2B_SANDBOX_URL=f"{base}/e2b", E2B_API_KEY="any"
        )
        yield base
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def egress_of(base_url: str, sandbox: Sandbox) -> object:
    with httpx.Client(base_url=base_url) as http:
        return http.get(f"/v1/sessions/{sandbox.sandbox_id}").json()["egress"]


def test_internet_access_gets_the_default_policy(base_url: str) -> None:
    with Sandbox.create(allow_internet_access=True) as sandbox:
        assert egress_of(base_url, sandbox) == {"policy": "default"}


def test_allow_out_narrows_it(base_url: str) -> None:
    with Sandbox.create(network={"allow_out": ["example.com:443"]}) as sandbox:
        assert egress_of(base_url, sandbox) == {"policy": "default", "allow": ["example.com:443"]}


def test_no_internet_access_reaches_nothing(base_url: str) -> None:
    with Sandbox.create(allow_internet_access=False) as sandbox:
        assert egress_of(base_url, sandbox) == {"policy": "default", "allow": []}


def test_a_rule_wider_than_the_ceiling_is_refused_by_name(base_url: str) -> None:
    with pytest.raises(SandboxException) as raised:
        Sandbox.create(network={"allow_out": ["evil.example.org:443"]})
    assert "403" in str(raised.value) and "evil.example.org:443" in str(raised.value)
