"""Snapshots, restores, forks, pause and resume, end to end against real gVisor sandboxes."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

import cloche
from support import ServerThread, make_config, require_gvisor

T1 = {"Authorization": "Bearer t1"}
T2 = {"Authorization": "Bearer t2"}

# A session holding what a pickle would lose: a half-consumed generator, a lambda, a file
# handle being written, a thread's state and an import made at run time.
BUILD_STATE = """
import threading, decimal
gen = (i * i for i in range(10)); next(gen); next(gen)
add = lambda x: x + 41
log = open('log.txt', 'w'); log.write('a'); log.flush()
ticks = {'n': 0}
stop = threading.Event()
def tick():
    while not stop.wait(0.005):
        ticks['n'] += 1
worker = threading.Thread(target=tick, daemon=True); worker.start()
open('/tmp/scratch.txt', 'w').write('tmp')
"""
CHECK_STATE = """
log.write('b'); log.close()
seen = ticks['n']
import time as _t
deadline = _t.monotonic() + 10
while ticks['n'] == seen and _t.monotonic() < deadline:
    _t.sleep(0.01)
(next(gen), add(1), open('log.txt').read(), str(decimal.Decimal('1.5')),
 open('/tmp/scratch.txt').read(), worker.is_alive(), ticks['n'] > seen)
"""
STATE_OK = "(4, 42, 'ab', '1.5', 'tmp', True, True)"


@pytest.fixture(scope="module")
def server(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    config = make_config(state_root, tokens=frozenset({"t1", "t2"}), pool_size=2)
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}", headers=T1, timeout=120
    ) as client:
        yield client


@pytest.fixture
def sdk(server: ServerThread) -> Iterator[cloche.Client]:
    with cloche.Client(f"http://127.0.0.1:{server.http_port}", token="t1") as client:
        yield client


def run(http: httpx.Client, session_id: str, code: str) -> dict[str, object]:
    response = http.post(f"/v1/sessions/{session_id}/execute", json={"code": code})
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    return body


def text(http: httpx.Client, session_id: str, code: str) -> str:
    body = run(http, session_id, code)
    assert body["status"] == "ok", body
    result = body["result"]
    assert isinstance(result, dict)
    return str(result["text/plain"])


def new_session(http: httpx.Client) -> str:
    response = http.post("/v1/sessions", json={})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def sandbox_ids(server: ServerThread) -> set[str]:
    runsc = server.server.backend.runsc  # type: ignore[attr-defined]
    return set(runsc.list_ids())


def only_known_sandboxes_run(server: ServerThread) -> bool:
    """Every runsc sandbox belongs to a session or waits in a pool (polled until a refill
    under way has joined its pool, with a deadline)."""
    manager = server.server.manager
    deadline = time.monotonic() + 60
    while True:
        known = {s.kernel.id for s in manager._sessions.values() if s.kernel is not None}
        known |= {k.id for pool in manager.pools.values() for k in pool._ready}
        running = sandbox_ids(server)
        if running <= known or time.monotonic() > deadline:
            return running <= known
        time.sleep(0.1)


def test_a_snapshot_restores_generators_lambdas_open_files_threads_and_imports(http, server):
    sid = new_session(http)
    assert run(http, sid, BUILD_STATE)["status"] == "ok"
    made = http.post(f"/v1/sessions/{sid}/snapshot", json={"name": "built"})
    assert made.status_code == 201, made.text
    snapshot = made.json()
    assert snapshot["session_id"] == sid and snapshot["name"] == "built"
    assert snapshot["execution_count"] == 1 and snapshot["size_bytes"] > 0
    assert http.get(f"/v1/snapshots/{snapshot['id']}").json() == snapshot
    assert snapshot["id"] in [s["id"] for s in http.get("/v1/snapshots").json()["snapshots"]]

    restored = http.post("/v1/sessions", json={"snapshot": snapshot["id"]})
    assert restored.status_code == 201, restored.text
    copy = restored.json()
    assert copy["id"] != sid and copy["execution_count"] == 1
    assert text(http, copy["id"], CHECK_STATE) == STATE_OK
    assert run(http, copy["id"], "1")["execution_count"] == 3  # continues from the snapshot's
    # The original went on, unaffected, with its own file.
    assert text(http, sid, CHECK_STATE) == STATE_OK
    assert text(http, sid, "open('log.txt').read()") == "'ab'"
    for session_id in (sid, copy["id"]):
        assert http.delete(f"/v1/sessions/{session_id}").status_code == 204
    assert http.delete(f"/v1/snapshots/{snapshot['id']}").status_code == 204
    assert http.get(f"/v1/snapshots/{snapshot['id']}").status_code == 404


def test_the_sdk_snapshots_restores_forks_pauses_and_resumes(sdk, server):
    with sdk.create_session() as session:
        assert session.run(BUILD_STATE).ok
        snapshot = session.snapshot("sdk")
        assert snapshot.id in [s.id for s in sdk.list_snapshots()]
        with sdk.create_session(snapshot=snapshot) as restored:
            assert restored.run(CHECK_STATE).text == STATE_OK
        copies = session.fork(3)
        try:
            assert len({c.id for c in copies} | {session.id}) == 4
            for number, copy in enumerate(copies):
                assert copy.run(f"mine = {number}\nnext(gen)").text == "4"
            assert [c.run("mine").text for c in copies] == ["0", "1", "2"]
            # Each copy drew its own random numbers; the original is unaffected.
            draws = {c.run("import random; random.random()").text for c in copies}
            assert len(draws) == 3
            assert session.run("'mine' in globals(), next(gen)").text == "(False, 4)"
        finally:
            for copy in copies:
                copy.close()
        assert session.pause().state == "paused"
        assert session.run("next(gen), add(1)").text == "(9, 42)"
        assert session.refresh().state == "idle"
        sdk.delete_snapshot(snapshot.id)
        with pytest.raises(cloche.SnapshotNotFound):
            sdk.get_snapshot(snapshot.id)


def test_a_streaming_cell_is_not_disturbed_by_a_snapshot_and_a_fork(http, server):
    sid = new_session(http)
    assert run(http, sid, "import time\nx = 7")["status"] == "ok"
    events: list[str] = []
    done: dict[str, object] = {}
    started = threading.Event()

    def stream() -> None:
        code = "for i in range(20):\n    print(i, flush=True)\n    time.sleep(0.05)\nx + 1"
        with http.stream(
            "POST", f"/v1/sessions/{sid}/execute?stream=true", json={"code": code}
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("event: "):
                    events.append(line[7:])
                    started.set()
                elif line.startswith("data: ") and events and events[-1] == "done":
                    done.update(json.loads(line[6:]))

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        snap = pool.submit(http.post, f"/v1/sessions/{sid}/snapshot")
        fork = pool.submit(http.post, f"/v1/sessions/{sid}/fork", json={"count": 2})
        snapshot, forked = snap.result(120), fork.result(120)
    thread.join(120)
    assert done.get("status") == "ok", (events, done)
    assert done["stdout"] == "".join(f"{i}\n" for i in range(20))
    assert events.count("stdout") >= 1 and "error" not in events
    assert snapshot.status_code == 201 and forked.status_code == 201, (snapshot, forked)
    # Both were taken between cells: after the streamed one.
    assert snapshot.json()["execution_count"] == 2
    for copy in forked.json()["sessions"]:
        assert text(http, copy["id"], "x, i") == "(7, 19)"
        http.delete(f"/v1/sessions/{copy['id']}")
    http.delete(f"/v1/snapshots/{snapshot.json()['id']}")
    http.delete(f"/v1/sessions/{sid}")


def test_a_paused_session_has_no_sandbox_and_any_request_resumes_it(http, server):
    sid = new_session(http)
    assert (
        run(http, sid, "import random\nrandom.seed(5)\nopen('f.txt', 'w').write('kept')")["status"]
        == "ok"
    )
    session = server.server.manager._sessions[sid]
    sandbox = session.kernel.id
    paused = http.post(f"/v1/sessions/{sid}/pause")
    assert paused.status_code == 200 and paused.json()["state"] == "paused", paused.text
    assert http.get(f"/v1/sessions/{sid}").json()["state"] == "paused"
    assert session.kernel is None
    deadline = time.monotonic() + 30
    while sandbox in sandbox_ids(server):  # its sandbox is stopped in the background
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # A file request resumes it; the state, exactly as it was (no reseed on resume).
    assert http.get(f"/v1/sessions/{sid}/files/f.txt").content == b"kept"
    assert http.get(f"/v1/sessions/{sid}").json()["state"] == "idle"
    expected = text(http, sid, "random.random()")
    # Pause again: an interrupt resumes it (and finds nothing running).
    assert http.post(f"/v1/sessions/{sid}/pause").json()["state"] == "paused"
    assert http.post(f"/v1/sessions/{sid}/interrupt").status_code == 200
    assert http.get(f"/v1/sessions/{sid}").json()["state"] == "idle"
    # Over TCP, with its token, a cell resumes it too.
    assert http.post(f"/v1/sessions/{sid}/pause").json()["state"] == "paused"
    with server.client() as tcp:
        reply = tcp.request(
            {"code": "random.seed(5); random.random()", "session_id": sid, "token": "t1"}
        )
    assert reply["status"] == "ok" and reply["output"] == f"{expected}\n", reply
    # Another token sees nothing of it, paused or not.
    assert http.post(f"/v1/sessions/{sid}/pause").json()["state"] == "paused"
    assert http.get(f"/v1/sessions/{sid}", headers=T2).status_code == 404
    assert http.post(f"/v1/sessions/{sid}/resume", headers=T2).status_code == 404
    assert http.delete(f"/v1/sessions/{sid}").status_code == 204
    assert not server.server.manager.store.session_dir(sid).exists()


def test_two_requests_resuming_one_paused_session_bring_it_back_once(http, server):
    sid = new_session(http)
    assert run(http, sid, "n = 0")["status"] == "ok"
    assert http.post(f"/v1/sessions/{sid}/pause").json()["state"] == "paused"
    resumes = server.server.manager.metrics.resumes.labels("ok")
    before = resumes._value.get()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: run(http, sid, "n += 1\nn"), range(2)))
    assert sorted(str(a["result"]["text/plain"]) for a in answers) == ["1", "2"]  # type: ignore[index]
    assert resumes._value.get() == before + 1
    http.delete(f"/v1/sessions/{sid}")


def test_a_pause_asked_while_a_cell_runs_waits_for_it(http, server):
    sid = new_session(http)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        cell = pool.submit(run, http, sid, "import time\ntime.sleep(1)\n'finished'")
        deadline = time.monotonic() + 60
        while http.get(f"/v1/sessions/{sid}").json()["state"] != "busy":
            assert time.monotonic() < deadline
        paused = http.post(f"/v1/sessions/{sid}/pause")
        result = cell.result(120)
    assert result["status"] == "ok" and result["result"] == {"text/plain": "'finished'"}
    assert paused.json()["state"] == "paused"
    assert text(http, sid, "time.time() > 0") == "True"
    http.delete(f"/v1/sessions/{sid}")


def test_unknown_or_other_owners_snapshots_are_not_found(http, server):
    assert http.get("/v1/snapshots/nope").status_code == 404
    assert http.post("/v1/sessions", json={"snapshot": "nope"}).status_code == 404
    sid = new_session(http)
    snapshot = http.post(f"/v1/sessions/{sid}/snapshot").json()
    for call in (
        lambda: http.get(f"/v1/snapshots/{snapshot['id']}", headers=T2),
        lambda: http.delete(f"/v1/snapshots/{snapshot['id']}", headers=T2),
        lambda: http.post("/v1/sessions", json={"snapshot": snapshot["id"]}, headers=T2),
    ):
        answer = call()
        assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found"
    assert http.get("/v1/snapshots", headers=T2).json() == {"snapshots": []}
    assert http.post(f"/v1/sessions/{sid}/fork", json={"count": 0}).status_code == 400
    too_many = http.post(f"/v1/sessions/{sid}/fork", json={"count": 1000})
    assert too_many.status_code == 400 and "--max-fork" in too_many.text
    http.delete(f"/v1/snapshots/{snapshot['id']}")
    http.delete(f"/v1/sessions/{sid}")


def test_a_damaged_or_foreign_image_is_refused_and_leaves_nothing(http, server):
    manager = server.server.manager
    sid = new_session(http)
    assert run(http, sid, "x = 1")["status"] == "ok"
    damaged = http.post(f"/v1/sessions/{sid}/snapshot").json()["id"]
    foreign = http.post(f"/v1/sessions/{sid}/snapshot").json()["id"]
    image = manager.store.snapshot_dir(damaged) / "image" / "checkpoint.img"
    image.write_bytes(image.read_bytes()[: image.stat().st_size // 3])  # truncated
    record = manager._snapshots[foreign]
    manager._snapshots[foreign] = type(record)(
        **{**record.__dict__, "origin": "gvisor python 3.11.7 runsc 0.0~20221219.0 ptrace"}
    )
    refused = http.post("/v1/sessions", json={"snapshot": damaged})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["type"] == "restore_refused"
    other = http.post("/v1/sessions", json={"snapshot": foreign})
    assert other.status_code == 422 and "20221219" in other.json()["error"]["message"]
    assert only_known_sandboxes_run(server)  # none left by the failed restores
    assert text(http, sid, "x + 1") == "2"  # the server is well
    assert http.get("/health").status_code == 200
    # A paused session whose image is damaged is reported lost, not hung, and stays so.
    assert http.post(f"/v1/sessions/{sid}/pause").json()["state"] == "paused"
    (manager.store.session_dir(sid) / "image" / "checkpoint.img").write_bytes(b"garbage")
    lost = http.post(f"/v1/sessions/{sid}/execute", json={"code": "x"})
    assert lost.status_code == 410, lost.text
    assert "could not be resumed" in lost.json()["error"]["message"]
    assert http.get(f"/v1/sessions/{sid}").status_code == 410
    assert only_known_sandboxes_run(server)
    for snapshot in (damaged, foreign):
        http.delete(f"/v1/snapshots/{snapshot}")


def test_a_full_data_dir_fails_the_checkpoint_and_the_session_runs_on(make_server, tmp_path):
    from cloche.sandbox import mounts

    data = tmp_path / "tiny"
    data.mkdir()
    mounts.mount_tmpfs(data, 1, 0, 0)  # 1 MiB: a lean image (~2 MiB) does not fit
    try:
        small = make_server(pool_size=1, data_dir=data)
        with httpx.Client(base_url=f"http://127.0.0.1:{small.http_port}", timeout=120) as http:
            sid = new_session(http)
            assert run(http, sid, "x = 41")["status"] == "ok"
            for path in ("snapshot", "pause", "fork"):
                full = http.post(f"/v1/sessions/{sid}/{path}")
                assert full.status_code == 507, (path, full.text)
                assert "no space" in full.json()["error"]["message"]
                assert text(http, sid, "x + 1") == "42"
            assert http.get(f"/v1/sessions/{sid}").json()["state"] == "idle"
            assert list((data / "sessions" / sid).iterdir()) == [
                data / "sessions" / sid / "record.json"
            ]
        small.stop()
    finally:
        mounts.unmount(data)


def test_the_data_dir_budget_refuses_new_images_clearly(make_server):
    tight = make_server(pool_size=1, data_max_mib=0)
    with httpx.Client(base_url=f"http://127.0.0.1:{tight.http_port}", timeout=120) as http:
        sid = new_session(http)
        refused = http.post(f"/v1/sessions/{sid}/snapshot")
        assert refused.status_code == 507 and "--data-max-mib" in refused.text
        assert text(http, sid, "1 + 1") == "2"


def test_idle_sessions_are_paused_and_answer_their_next_cell_with_their_state(make_server):
    from cloche.config import Limits

    quick = make_server(
        pool_size=2, limits=Limits(pause_idle_s=1.0, cell_timeout_s=20.0, interrupt_grace_s=1.0)
    )
    manager = quick.server.manager
    with quick.client() as tcp:
        ids = [tcp.run(f"mine = {n}")["session_id"] for n in range(6)]
        deadline = time.monotonic() + 120
        while manager.paused_count < len(ids):
            assert time.monotonic() < deadline, manager.paused_count
            time.sleep(0.1)  # polling the observable state, with a deadline
        assert manager.session_count == 0
        assert only_known_sandboxes_run(quick)  # the paused ones have none
        for n, sid in enumerate(ids):
            reply = tcp.run("mine", sid)
            assert (reply["status"], reply["output"], reply["session_id"]) == ("ok", f"{n}\n", sid)
    assert manager.metrics.pauses.labels("idle")._value.get() >= len(ids)


def test_at_the_maximum_the_least_recently_used_idle_session_is_paused_for_room(make_server):
    small = make_server(max_sessions=2, pool_size=1)
    with small.client() as tcp:
        first = tcp.run("me = 'first'")["session_id"]
        second = tcp.run("me = 'second'")["session_id"]
        third = tcp.run("me = 'third'")
        assert third["status"] == "ok", third
        manager = small.server.manager
        assert manager._sessions[first].paused and not manager._sessions[second].paused
        assert tcp.run("me", first)["output"] == "'first'\n"  # resumed; second paused now
        assert manager._sessions[second].paused
        assert manager.metrics.pauses.labels("room")._value.get() == 2


def test_a_paused_session_still_expires_and_its_image_is_deleted(make_server):
    from cloche.config import Limits

    quick = make_server(
        pool_size=1,
        limits=Limits(pause_idle_s=0.3, idle_timeout_s=3.0, cell_timeout_s=20.0),
    )
    manager = quick.server.manager
    with quick.client() as tcp:
        sid = tcp.run("x = 1")["session_id"]
        home = manager.store.session_dir(sid)
        deadline = time.monotonic() + 60
        while not (home / "image").exists():  # paused first
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while manager.closed_by_reason["idle"] < 1:  # then closed by its idle timeout
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert tcp.run("x", sid) == {"status": "error", "error": f"Session {sid} not found"}
        while home.exists():  # deleted in the background
            assert time.monotonic() < deadline
            time.sleep(0.05)
