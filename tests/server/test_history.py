"""Cell history, metadata and typed end reasons over HTTP (operations.md), real gVisor."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloche.config import Limits
from support import ServerThread, make_config, require_gvisor


@pytest.fixture(scope="module")
def history_server(state_root: Path) -> Iterator[ServerThread]:
    require_gvisor()
    with ServerThread(make_config(state_root, history_output_bytes=1000)) as running:
        yield running


@pytest.fixture
def http(history_server: ServerThread) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{history_server.http_port}"
    with httpx.Client(base_url=base, timeout=120) as client:
        yield client


def new_session(http: httpx.Client, **body: Any) -> str:
    created = http.post("/v1/sessions", json=body)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def run(http: httpx.Client, session: str, code: str, **body: Any) -> dict[str, Any]:
    answer = http.post(f"/v1/sessions/{session}/execute", json={"code": code, **body})
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def cells(http: httpx.Client, session: str, **params: Any) -> list[dict[str, Any]]:
    answer = http.get(f"/v1/sessions/{session}/cells", params=params)
    assert answer.status_code == 200, answer.text
    found: list[dict[str, Any]] = answer.json()["cells"]
    return found


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.split()[-1])
    return 0.0


def test_the_history_keeps_each_cell_with_its_outputs_and_end_reason(http):
    session = new_session(http)
    run(http, session, "print('hello')\n6 * 7")
    run(http, session, "1 / 0")
    run(http, session, "print('x' * 5000)")
    kept = cells(http, session)
    assert [c["number"] for c in kept] == [1, 2, 3]
    first, second, third = kept
    assert (first["code"], first["stdout"], first["status"]) == (
        "print('hello')\n6 * 7",
        "hello\n",
        "ok",
    )
    assert first["result"] == {"text/plain": "42"}
    assert first["end_reason"] == "ok" and first["front_end"] == "http"
    assert first["ended_at"] >= first["started_at"] > 0
    assert second["end_reason"] == "error" and second["error"]["ename"] == "ZeroDivisionError"
    # stdout is cut to --history-output-bytes (1000 here), with a marker saying so
    assert third["stdout"].startswith("x" * 1000)
    assert "4001 more bytes not kept in the history" in third["stdout"]
    assert http.get(f"/v1/sessions/{session}/cells/2").json()["code"] == "1 / 0"
    assert [c["number"] for c in cells(http, session, after=1, limit=1)] == [2]
    gone = http.get(f"/v1/sessions/{session}/cells/99")
    assert gone.status_code == 404 and "no cell 99" in gone.json()["error"]["message"]
    info = http.get(f"/v1/sessions/{session}").json()
    assert info["last_cell"]["number"] == 3 and info["last_cell"]["end_reason"] == "ok"


def test_another_owner_or_an_unknown_session_has_no_history(make_server):
    guarded = make_server(pool_size=1, tokens=frozenset({"alice", "bob"}))
    base = f"http://127.0.0.1:{guarded.http_port}"
    alice = httpx.Client(base_url=base, timeout=120, headers={"Authorization": "Bearer alice"})
    bob = httpx.Client(base_url=base, timeout=120, headers={"Authorization": "Bearer bob"})
    with alice, bob:
        session = new_session(alice)
        run(alice, session, "secret = 1")
        assert bob.get(f"/v1/sessions/{session}/cells").status_code == 404
        assert bob.get(f"/v1/sessions/{session}/cells/1").status_code == 404
        assert (
            bob.patch(f"/v1/sessions/{session}", json={"metadata": {"a": "b"}}).status_code == 404
        )
        assert alice.get("/v1/sessions/nope/cells").status_code == 404


def test_history_metadata_and_cell_timeout_survive_pause_snapshot_fork_and_a_restart(
    state_root, tmp_path
):
    require_gvisor()
    config = make_config(state_root, pool_size=1, data_dir=tmp_path / "data")
    with ServerThread(config) as first:
        with httpx.Client(base_url=f"http://127.0.0.1:{first.http_port}", timeout=120) as api:
            session = new_session(api, metadata={"run": "7"}, timeout=1.5)
            run(api, session, "a = 1")
            run(api, session, "print(a + 1)")
            assert api.post(f"/v1/sessions/{session}/pause").status_code == 200
            assert api.get(f"/v1/sessions/{session}").json()["state"] == "paused"
            # a paused session answers its history without being woken
            assert [c["code"] for c in cells(api, session)] == ["a = 1", "print(a + 1)"]
            assert api.get(f"/v1/sessions/{session}").json()["state"] == "paused"
            run(api, session, "b = 2")  # resumed
            snapshot = api.post(f"/v1/sessions/{session}/snapshot", json={}).json()["id"]
            restored = new_session(api, snapshot=snapshot)
            assert [c["code"] for c in cells(api, restored)] == ["a = 1", "print(a + 1)", "b = 2"]
            assert api.get(f"/v1/sessions/{restored}").json()["metadata"] == {"run": "7"}
            copies = api.post(f"/v1/sessions/{session}/fork", json={"count": 1})
            assert copies.status_code == 201, copies.text
            copy = copies.json()["sessions"][0]["id"]
            assert len(cells(api, copy)) == 3
            assert api.get(f"/v1/sessions/{copy}").json()["limits"]["cell_timeout_s"] == 1.5
            run(api, copy, "c = 3")  # the copy's history goes on alone
            assert len(cells(api, copy)) == 4 and len(cells(api, session)) == 3
    with ServerThread(config) as second:
        with httpx.Client(base_url=f"http://127.0.0.1:{second.http_port}", timeout=120) as api:
            kept = cells(api, session)
            assert [c["code"] for c in kept] == ["a = 1", "print(a + 1)", "b = 2"]
            assert kept[1]["stdout"] == "2\n"
            assert api.get(f"/v1/sessions/{session}").json()["metadata"] == {"run": "7"}
            assert run(api, session, "a + b")["result"]["text/plain"] == "3"
            assert [c["number"] for c in cells(api, session)] == [1, 2, 3, 4]
            # its own default cell time limit is kept too (the server's is 20 s)
            assert api.get(f"/v1/sessions/{session}").json()["limits"]["cell_timeout_s"] == 1.5
            assert run(api, session, "while True: pass")["end_reason"] == "timeout"


def test_metadata_is_set_merged_and_filters_the_listing(http):
    planner = new_session(http, metadata={"agent": "planner", "run": "42"})
    coder = new_session(http, metadata={"agent": "coder", "run": "42"})
    other = new_session(http, metadata={"agent": "coder", "run": "43"})

    def listed(**params: str) -> set[str]:
        answer = http.get("/v1/sessions", params=params)
        assert answer.status_code == 200, answer.text
        return {s["id"] for s in answer.json()["sessions"]} & {planner, coder, other}

    assert listed(**{"metadata.run": "42"}) == {planner, coder}
    assert listed(**{"metadata.run": "42", "metadata.agent": "coder"}) == {coder}
    assert listed(**{"metadata.agent": "nobody"}) == set()
    patched = http.patch(f"/v1/sessions/{other}", json={"metadata": {"run": "42", "agent": None}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["metadata"] == {"run": "42"}
    assert listed(**{"metadata.run": "42"}) == {planner, coder, other}
    assert http.post(f"/v1/sessions/{planner}/pause").status_code == 200
    assert listed(state="paused") == {planner}
    assert listed(state="idle", **{"metadata.run": "42"}) == {coder, other}
    assert listed(profile="data") == set()


@pytest.mark.parametrize(
    ("metadata", "why"),
    [
        ({f"k{i}": "v" for i in range(33)}, "at most 32"),
        ({"big": "x" * 5000}, "at most 4096"),
        ({"n": 1}, "valid string"),
        ({"": "v"}, "non-empty"),
    ],
)
def test_bad_metadata_is_refused_and_nothing_is_made(http, metadata, why):
    before = len(http.get("/v1/sessions").json()["sessions"])
    refused = http.post("/v1/sessions", json={"metadata": metadata})
    assert refused.status_code in (400, 422), refused.text
    assert why in refused.text
    assert len(http.get("/v1/sessions").json()["sessions"]) == before


def test_a_patch_past_the_limits_is_refused_and_keeps_the_metadata(http):
    session = new_session(http, metadata={"keep": "me"})
    refused = http.patch(
        f"/v1/sessions/{session}", json={"metadata": {f"k{i}": "v" for i in range(40)}}
    )
    assert refused.status_code == 400 and "at most 32" in refused.text
    assert http.get(f"/v1/sessions/{session}").json()["metadata"] == {"keep": "me"}


# -- why things ended -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def strict_server(state_root: Path) -> Iterator[ServerThread]:
    """Short timeouts, and a memory backstop small enough to reach."""
    require_gvisor()
    limits = Limits(cell_timeout_s=60.0, interrupt_grace_s=1.0, memory_mib=256)
    with ServerThread(make_config(state_root, limits=limits)) as running:
        yield running


@pytest.fixture
def strict(strict_server: ServerThread) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{strict_server.http_port}"
    with httpx.Client(base_url=base, timeout=120) as client:
        yield client


def test_a_timeout_an_ignored_interrupt_and_a_memory_error_each_say_why(strict):
    session = new_session(strict)
    before = {
        r: metric(strict, "cloche_cell_ends_total", end_reason=r)
        for r in ("timeout", "killed", "memory")
    }
    assert run(strict, session, "while True: pass", timeout=2)["end_reason"] == "timeout"
    assert run(strict, session, "x = bytearray(2 * 1024**3)")["end_reason"] == "memory"
    assert run(strict, session, "print('y' * 2_000_000)")["end_reason"] == "output_limit"
    assert [c["end_reason"] for c in cells(strict, session)] == [
        "timeout",
        "memory",
        "output_limit",
    ]
    deaf = run(
        strict,
        session,
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass",
        timeout=2,
    )
    assert (deaf["status"], deaf["end_reason"]) == ("killed", "killed"), deaf
    for reason in ("timeout", "killed", "memory"):
        assert metric(strict, "cloche_cell_ends_total", end_reason=reason) == before[reason] + 1


def test_the_memory_cgroups_oom_kill_is_told_apart_from_a_sandbox_killed_outside(
    strict, strict_server
):
    oom_before = metric(strict, "cloche_session_ends_total", end_reason="oom_killed")
    died_before = metric(strict, "cloche_session_ends_total", end_reason="sandbox_died")
    hog = new_session(strict)
    code = (
        "import os, resource, time\n"
        "limit = resource.getrlimit(resource.RLIMIT_AS)[0]\n"
        "status = open('/proc/self/status').read()\n"
        "size = int(status.split('VmSize:')[1].split()[0]) * 1024\n"
        "block = limit - size - 32 * 1024**2  # what a child may take under its rlimit\n"
        "for _ in range(12):\n"
        "    if os.fork() == 0:\n"
        "        try:\n"
        "            block = bytearray(block)\n"
        "            for i in range(0, len(block), 4096): block[i] = 1\n"
        "        except MemoryError: pass\n"
        "        time.sleep(30); os._exit(0)\n"
        "time.sleep(30)"
    )
    killed = run(strict, hog, code, timeout=30)
    assert (killed["status"], killed["end_reason"]) == ("killed", "memory"), killed
    assert "OOM killer" in killed["message"], killed

    victim = new_session(strict)
    run(strict, victim, "x = 1")
    manager: Any = strict_server.server.manager
    process = manager._sessions[victim].kernel.sandbox.process
    os.kill(process.pid, signal.SIGKILL)  # the sandbox's runsc, which this test's server started
    dead = strict.post(f"/v1/sessions/{victim}/execute", json={"code": "x"})
    while dead.status_code == 200 and dead.json().get("status") != "killed":
        dead = strict.post(f"/v1/sessions/{victim}/execute", json={"code": "x"})
    assert strict.get(f"/v1/sessions/{victim}").status_code in (404, 410)

    # A dead sandbox's session is told of once its death is explained: wait for that.
    wanted = {"oom_killed": oom_before + 1, "sandbox_died": died_before + 1}
    assert eventually(lambda: all(ends(strict)[k] >= v for k, v in wanted.items())), ends(strict)
    assert ends(strict) == wanted


def ends(http: httpx.Client) -> dict[str, float]:
    return {
        reason: metric(http, "cloche_session_ends_total", end_reason=reason)
        for reason in ("oom_killed", "sandbox_died")
    }


def eventually(check: Any, timeout_s: float = 30.0) -> bool:
    """Poll check (a state the server reaches by itself) until it holds or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


def test_a_session_closed_by_its_idle_timeout_ends_as_idle_timeout(make_server):
    quick = make_server(pool_size=1, limits=replace(Limits(), idle_timeout_s=0.5, pause_idle_s=0.0))
    with httpx.Client(base_url=f"http://127.0.0.1:{quick.http_port}", timeout=120) as api:
        before = metric(api, "cloche_session_ends_total", end_reason="idle_timeout")
        session = new_session(api)
        while api.get(f"/v1/sessions/{session}").status_code == 200:
            pass  # the reaper closes it within a few of its periods
        assert metric(api, "cloche_session_ends_total", end_reason="idle_timeout") == before + 1
        assert metric(api, "cloche_session_ends_total", end_reason="closed") == 0


def test_a_listing_shows_what_each_sandbox_has_used(http):
    session = new_session(http)
    run(
        http,
        session,
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
        "block = bytearray(64 * 1024**2)\nfor i in range(0, len(block), 4096): block[i] = 1",
    )
    listed = {s["id"]: s for s in http.get("/v1/sessions").json()["sessions"]}[session]
    assert listed["cpu_s"] >= 0.3, listed
    assert listed["memory_bytes"] >= 64 * 1024**2, listed
    alone = http.get(f"/v1/sessions/{session}").json()  # not read for one session's look
    assert alone["cpu_s"] is None and alone["memory_bytes"] is None
