"""Sessions paused at shutdown come back as the next server starts, before anyone asks."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from support import ServerThread, make_config, require_gvisor


def state_of(api: httpx.Client, session: str) -> str:
    answer = api.get(f"/v1/sessions/{session}")  # a look: it wakes no session
    assert answer.status_code == 200, answer.text
    return str(answer.json()["state"])


def until_idle(api: httpx.Client, sessions: list[str], timeout_s: float = 120.0) -> list[str]:
    """The states of sessions once all are idle, or when time runs out (polled)."""
    deadline = time.monotonic() + timeout_s
    states = [state_of(api, s) for s in sessions]
    while any(state != "idle" for state in states) and time.monotonic() < deadline:
        time.sleep(0.1)
        states = [state_of(api, s) for s in sessions]
    return states


@pytest.mark.parametrize("resume", [True, False])
def test_sessions_paused_at_shutdown_are_resumed_at_start(
    state_root: Path, tmp_path: Path, resume: bool
) -> None:
    require_gvisor()
    config = make_config(
        state_root, pool_size=1, data_dir=tmp_path / "data", resume_at_start=resume
    )
    with ServerThread(config) as first:
        with httpx.Client(base_url=f"http://127.0.0.1:{first.http_port}", timeout=120) as api:
            live = [api.post("/v1/sessions").json()["id"] for _ in range(3)]
            for index, session in enumerate(live):
                ran = api.post(f"/v1/sessions/{session}/execute", json={"code": f"v = {index}"})
                assert ran.json()["status"] == "ok", ran.text
            parked = api.post("/v1/sessions").json()["id"]
            assert api.post(f"/v1/sessions/{parked}/pause").json()["state"] == "paused"
    with ServerThread(config) as second:
        with httpx.Client(base_url=f"http://127.0.0.1:{second.http_port}", timeout=120) as api:
            if resume:
                assert until_idle(api, live) == ["idle"] * 3
                manager = second.server.manager
                assert all(manager._sessions[s].kernel is not None for s in live)
            else:
                assert [state_of(api, s) for s in live] == ["paused"] * 3
            assert state_of(api, parked) == "paused"  # paused on purpose: it stays so
            for index, session in enumerate(live):
                ran = api.post(f"/v1/sessions/{session}/execute", json={"code": "v"})
                assert ran.json()["result"]["text/plain"] == str(index), ran.text


def test_a_restore_that_fails_to_start_is_tried_again(make_server, monkeypatch) -> None:
    """The first restore of a fork fails as runsc did once under load; the fork still
    makes its copy, and says why in the log."""
    from cloche.errors import SandboxStartError
    from cloche.sessions.durable import Checkpoints

    server = make_server(pool_size=1)
    real = Checkpoints._restore_once
    failures: list[str] = []

    async def flaky(self, home, *rest):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(str(home))
            raise SandboxStartError("runsc restore: exit status 128 (injected)")
        return await real(self, home, *rest)

    monkeypatch.setattr(Checkpoints, "_restore_once", flaky)
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120) as api:
        session = api.post("/v1/sessions").json()["id"]
        api.post(f"/v1/sessions/{session}/execute", json={"code": "v = 'kept'"})
        forked = api.post(f"/v1/sessions/{session}/fork", json={"count": 1})
        assert forked.status_code == 201, forked.text
        copy = forked.json()["sessions"][0]["id"]
        ran = api.post(f"/v1/sessions/{copy}/execute", json={"code": "v"})
        assert ran.json()["result"]["text/plain"] == "'kept'"
    assert len(failures) == 1
