"""Volumes through a real gVisor server: files that outlive sessions, shared between
sessions at once, held to their size, a tenant's own, mounted again by name on every
sandbox a session runs on (resume, snapshot restore, fork, restart), never held by a
snapshot; their files reached without a session."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

import cloche
from cloche.sandbox import mounts
from support import (
    NOTHING_LEFT,
    ServerProcess,
    ServerThread,
    leftovers,
    make_config,
    require_gvisor,
)

pytestmark = pytest.mark.timeout(900)
ALICE, BOB = "alice-token", "bob-token"


@pytest.fixture(scope="module")
def server(state_root: Path) -> Iterator[ServerThread]:
    require_gvisor()
    config = make_config(state_root, pool_size=1, tokens=frozenset({ALICE, BOB}))
    with ServerThread(config) as running:
        yield running


def api(server: ServerThread, token: str = ALICE) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.http_port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=300,
    )


@pytest.fixture
def alice(server: ServerThread) -> Iterator[httpx.Client]:
    with api(server, ALICE) as client:
        yield client


@pytest.fixture
def bob(server: ServerThread) -> Iterator[httpx.Client]:
    with api(server, BOB) as client:
        yield client


class Volume:
    """A volume made for one test, and the sessions it opened; all gone at its end."""

    def __init__(self, client: httpx.Client, name: str, size_mib: int = 16) -> None:
        self.client = client
        self.name = name
        self.sessions: list[str] = []
        made = client.post("/v1/volumes", json={"name": name, "size_mib": size_mib})
        assert made.status_code == 201, made.text

    def session(self, path: str = "/home/user/data", read_only: bool = False, **more: Any) -> str:
        body = {"volumes": [{"name": self.name, "path": path, "read_only": read_only}], **more}
        made = self.client.post("/v1/sessions", json=body)
        assert made.status_code == 201, made.text
        self.sessions.append(made.json()["id"])
        return str(made.json()["id"])

    def run(self, session_id: str, code: str) -> dict[str, Any]:
        done = self.client.post(f"/v1/sessions/{session_id}/execute", json={"code": code})
        assert done.status_code == 200, done.text
        result: dict[str, Any] = done.json()
        return result

    def value(self, session_id: str, code: str) -> Any:
        """The last expression's JSON value of a cell that must succeed."""
        result = self.run(session_id, code)
        assert result["status"] == "ok", result
        return result["result_json"]

    def close(self) -> None:
        for session_id in self.sessions:
            self.client.delete(f"/v1/sessions/{session_id}")
        gone = self.client.delete(f"/v1/volumes/{self.name}")
        assert gone.status_code in (204, 404), gone.text


@pytest.fixture
def volume(alice: httpx.Client, request: pytest.FixtureRequest) -> Iterator[Volume]:
    made = Volume(alice, request.node.name.removeprefix("test_")[:60].replace("[", "-"))
    yield made
    made.close()


def loop_devices_under(root: Path, timeout_s: float = 60.0) -> list[str]:
    """The loop devices attached to images under root, once none is left or after
    timeout_s: a loop device lets go of its image just after the last unmount, not at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True)
        found = [line for line in out.stdout.splitlines() if str(root) in line]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def loop_devices_of(server: ServerThread) -> list[str]:
    """The loop devices still attached to this server's volume images."""
    return loop_devices_under(server.config.volumes_root)


def test_data_written_in_one_session_is_read_in_the_next(volume: Volume) -> None:
    first = volume.session()
    volume.value(first, "open('/home/user/data/notes.txt', 'w').write('kept'); 0")
    volume.client.delete(f"/v1/sessions/{first}")
    second = volume.session(path="/mnt/elsewhere")
    assert volume.value(second, "open('/mnt/elsewhere/notes.txt').read()") == "kept"


def test_two_sessions_at_once_see_each_others_writes_at_once(volume: Volume) -> None:
    one, other = volume.session(), volume.session(path="/mnt/shared")
    for round_ in range(5):  # no sleep anywhere: written by one, read by the other at once
        text = f"round {round_} " * (round_ + 1)
        volume.value(one, f"open('/home/user/data/f', 'w').write({text!r}); 0")
        assert volume.value(other, "open('/mnt/shared/f').read()") == text
        volume.value(other, f"open('/mnt/shared/g{round_}', 'w').write('x'); 0")
        listed = volume.value(one, "import os; sorted(os.listdir('/home/user/data'))")
        assert f"g{round_}" in listed
    # A file one holds open sees what the other appends.
    volume.value(one, "held = open('/home/user/data/f'); held.read(); 0")
    volume.value(other, "open('/mnt/shared/f', 'a').write('appended'); 0")
    assert volume.value(one, "held.read()") == "appended"
    volume.value(other, "import os; os.unlink('/mnt/shared/g0'); 0")
    assert volume.value(one, "import os; os.path.exists('/home/user/data/g0')") is False


def test_a_read_only_mount_refuses_writes(volume: Volume) -> None:
    writer = volume.session()
    volume.value(writer, "open('/home/user/data/f', 'w').write('from the writer'); 0")
    reader = volume.session(path="/mnt/ro", read_only=True)
    assert volume.value(reader, "open('/mnt/ro/f').read()") == "from the writer"
    refused = volume.value(
        reader,
        "import errno, os\n"
        "def errno_of(action):\n"
        "    try:\n"
        "        action()\n"
        "    except OSError as exc:\n"
        "        return errno.errorcode[exc.errno]\n"
        "[errno_of(lambda: open('/mnt/ro/f', 'w')), errno_of(lambda: open('/mnt/ro/new', 'x')),"
        " errno_of(lambda: os.unlink('/mnt/ro/f')), errno_of(lambda: os.mkdir('/mnt/ro/d'))]",
    )
    assert refused == ["EROFS"] * 4
    assert volume.value(writer, "open('/home/user/data/f').read()") == "from the writer"


def test_a_write_past_the_size_gets_enospc_and_the_session_lives(alice: httpx.Client) -> None:
    small = Volume(alice, "small", size_mib=8)
    try:
        session_id = small.session()
        outcome = small.value(
            session_id,
            "import errno\n"
            "written = 0\n"
            "try:\n"
            "    with open('/home/user/data/big', 'wb') as out:\n"
            "        for _ in range(16):\n"
            "            out.write(b'x' * 2**20); out.flush(); written += 2**20\n"
            "    outcome = 'no error'\n"
            "except OSError as exc:\n"
            "    outcome = errno.errorcode[exc.errno]\n"
            "[outcome, written]",
        )
        assert outcome[0] == "ENOSPC"
        assert outcome[1] < 8 * 2**20
        assert small.value(session_id, "6 * 7") == 42  # the session lives
        info = alice.get("/v1/volumes/small").json()
        assert info["used_bytes"] <= info["capacity_bytes"] <= 8 * 2**20
        # Freed, it takes writes again.
        small.value(session_id, "import os; os.unlink('/home/user/data/big'); 0")
        assert small.value(session_id, "open('/home/user/data/ok', 'w').write('y' * 2**20)") > 0
    finally:
        small.close()


def test_another_tenant_gets_404_and_may_use_the_same_name(
    volume: Volume, alice: httpx.Client, bob: httpx.Client
) -> None:
    name = volume.name
    session_id = volume.session()
    volume.value(session_id, "open('/home/user/data/secret', 'w').write('alice'); 0")
    assert bob.get(f"/v1/volumes/{name}").status_code == 404
    assert bob.get(f"/v1/volumes/{name}/files").status_code == 404
    assert bob.get(f"/v1/volumes/{name}/files/secret").status_code == 404
    assert bob.put(f"/v1/volumes/{name}/files/x", content=b"bob").status_code == 404
    assert bob.delete(f"/v1/volumes/{name}").status_code == 404
    assert name not in [v["name"] for v in bob.get("/v1/volumes").json()["volumes"]]
    refused = bob.post("/v1/sessions", json={"volumes": [{"name": name}]})
    assert refused.status_code == 404
    assert f"Volume {name} not found" in refused.json()["error"]["message"]
    own = Volume(bob, name)  # the same name, Bob's own
    try:
        bobs = own.session()
        assert own.value(bobs, "import os; os.listdir('/home/user/data')") == []
    finally:
        own.close()
    assert alice.get(f"/v1/volumes/{name}/files/secret").content == b"alice"


def test_pause_and_resume_mount_the_volume_again_with_its_current_contents(
    volume: Volume,
) -> None:
    session_id = volume.session()
    volume.value(session_id, "kept = 'in memory'; open('/home/user/data/f', 'w').write('old'); 0")
    paused = volume.client.post(f"/v1/sessions/{session_id}/pause")
    assert paused.json()["state"] == "paused"
    assert volume.client.delete(f"/v1/volumes/{volume.name}").status_code == 409
    files = f"/v1/volumes/{volume.name}/files"
    assert volume.client.put(f"{files}/f", content=b"new").status_code == 204
    assert volume.client.put(f"{files}/made/while/paused", content=b"yes").status_code == 204
    resumed = volume.client.post(f"/v1/sessions/{session_id}/resume")
    assert resumed.json()["state"] == "idle"
    assert volume.value(session_id, "kept") == "in memory"
    seen = volume.value(
        session_id,
        "[open('/home/user/data/f').read(), open('/home/user/data/made/while/paused').read()]",
    )
    assert seen == ["new", "yes"]
    # And writes of the resumed session land in the volume.
    volume.value(session_id, "open('/home/user/data/after', 'w').write('resumed'); 0")
    assert volume.client.get(f"/v1/volumes/{volume.name}/files/after").content == b"resumed"
    # A session beside it and the resumed one see each other's writes at once.
    beside = volume.session(path="/mnt/beside")
    for round_ in range(3):
        volume.value(beside, f"open('/mnt/beside/f', 'w').write('beside {round_}'); 0")
        assert volume.value(session_id, "open('/home/user/data/f').read()") == f"beside {round_}"
        volume.value(session_id, f"open('/home/user/data/f', 'w').write('resumed {round_}'); 0")
        assert volume.value(beside, "open('/mnt/beside/f').read()") == f"resumed {round_}"


def test_a_snapshot_does_not_hold_the_volume_and_its_restore_mounts_it_again(
    volume: Volume,
) -> None:
    client, name = volume.client, volume.name
    session_id = volume.session()
    volume.value(session_id, "x = 41; open('/home/user/data/f', 'w').write('at the snapshot'); 0")
    snapshot = client.post(f"/v1/sessions/{session_id}/snapshot").json()["id"]
    volume.value(session_id, "open('/home/user/data/f', 'w').write('after it'); 0")
    restored = client.post("/v1/sessions", json={"snapshot": snapshot})
    assert restored.status_code == 201, restored.text
    copy = restored.json()["id"]
    volume.sessions.append(copy)
    assert restored.json()["volumes"] == [
        {"name": name, "path": "/home/user/data", "read_only": False}
    ]
    assert volume.value(copy, "x + 1") == 42
    assert volume.value(copy, "open('/home/user/data/f').read()") == "after it"
    # Both mount it: the copy's writes are the original's to read.
    volume.value(copy, "open('/home/user/data/g', 'w').write('from the copy'); 0")
    assert volume.value(session_id, "open('/home/user/data/g').read()") == "from the copy"
    for each in (session_id, copy):
        client.delete(f"/v1/sessions/{each}")
    assert client.delete(f"/v1/volumes/{name}").status_code == 204  # the snapshot holds none
    again = client.post("/v1/sessions", json={"snapshot": snapshot})
    assert again.status_code == 404
    message = again.json()["error"]["message"]
    assert f"Volume {name} not found" in message and snapshot in message
    client.delete(f"/v1/snapshots/{snapshot}")


def test_forks_and_restarts_mount_the_volume_again(volume: Volume) -> None:
    client = volume.client
    session_id = volume.session()
    volume.value(session_id, "open('/home/user/data/f', 'w').write('one'); 0")
    forked = client.post(f"/v1/sessions/{session_id}/fork", json={"count": 2})
    assert forked.status_code == 201, forked.text
    copies = [s["id"] for s in forked.json()["sessions"]]
    volume.sessions += copies
    for number, copy in enumerate(copies):
        volume.value(copy, f"open('/home/user/data/copy{number}', 'w').write('c'); 0")
    listed = volume.value(session_id, "import os; sorted(os.listdir('/home/user/data'))")
    assert listed == ["copy0", "copy1", "f"]
    info = client.get(f"/v1/volumes/{volume.name}").json()
    assert sorted(info["sessions"]) == sorted([session_id, *copies])
    restarted = client.post(f"/v1/sessions/{session_id}/restart")
    assert restarted.status_code == 200, restarted.text
    assert volume.value(session_id, "open('/home/user/data/copy1').read()") == "c"


def test_delete_is_409_while_mounted_then_204(volume: Volume, server: ServerThread) -> None:
    client, name = volume.client, volume.name
    session_id = volume.session()
    volume.value(session_id, "open('/home/user/data/f', 'w').write('x'); 0")
    refused = client.delete(f"/v1/volumes/{name}")
    assert refused.status_code == 409
    assert session_id in refused.json()["error"]["message"]
    assert client.get(f"/v1/volumes/{name}/files/f").content == b"x"  # nothing was lost
    client.delete(f"/v1/sessions/{session_id}")
    assert client.delete(f"/v1/volumes/{name}").status_code == 204
    assert client.get(f"/v1/volumes/{name}").status_code == 404
    assert loop_devices_of(server) == []
    assert not (server.config.volumes_root / name).exists()


def test_the_files_api_reads_writes_lists_and_deletes(volume: Volume) -> None:
    client, base = volume.client, f"/v1/volumes/{volume.name}/files"
    assert client.put(f"{base}/deep/er/file.bin", content=b"\0\1\2" * 1000).status_code == 204
    assert client.put(f"{base}/top.txt", content=b"top").status_code == 204
    listing = client.get(base).json()
    assert [(f["path"], f["size_bytes"]) for f in listing["files"]] == [
        ("deep/er/file.bin", 3000),
        ("top.txt", 3),
    ]
    assert client.get(f"{base}/deep/er/file.bin").content == b"\0\1\2" * 1000
    session_id = volume.session()
    owner = volume.value(session_id, "import os; os.stat('/home/user/data/top.txt').st_uid")
    assert owner == 1000  # the sandbox's user's
    assert client.delete(f"{base}/deep").status_code == 204
    assert client.get(f"{base}/deep/er/file.bin").status_code == 404
    assert client.delete(f"{base}/top.txt").status_code == 204
    assert client.get(base).json()["files"] == []
    assert client.delete(f"{base}/top.txt").status_code == 404


def test_an_upload_past_the_size_is_refused_and_leaves_nothing(alice: httpx.Client) -> None:
    small = Volume(alice, "tiny", size_mib=4)
    try:
        base = "/v1/volumes/tiny/files"

        def chunks() -> Iterator[bytes]:
            for _ in range(8):
                yield b"z" * 2**20

        refused = alice.put(f"{base}/big", content=chunks())
        assert refused.status_code == 507, refused.text
        assert refused.json()["error"]["type"] == "volume_full"
        assert alice.get(base).json()["files"] == []
        assert alice.get("/v1/volumes/tiny").json()["used_bytes"] < 2**20
        assert alice.put(f"{base}/fits", content=b"z" * 2**20).status_code == 204
    finally:
        small.close()


def test_bad_requests_are_refused_clearly(alice: httpx.Client, volume: Volume) -> None:
    for body in (
        {"name": "../x", "size_mib": 4},
        {"name": ".hidden", "size_mib": 4},
        {"name": "ok", "size_mib": 0},
        {"name": "ok", "size_mib": 10**9},
        {"name": "ok"},
        {"name": "ok", "size_mib": 4, "extra": 1},
    ):
        refused = alice.post("/v1/volumes", json=body)
        assert refused.status_code == 400, (body, refused.text)
    assert alice.post("/v1/volumes", json={"name": volume.name, "size_mib": 4}).status_code == 409
    for mount in (
        {"name": volume.name, "path": "/proc/x"},
        {"name": volume.name, "path": "/dev"},
        {"name": volume.name, "path": "/sys/fs"},
        {"name": volume.name, "path": "relative"},
        {"name": volume.name, "path": "/mnt/../etc"},
        {"name": volume.name, "path": "/"},
        {"name": volume.name, "path": "/usr"},
        {"name": volume.name, "path": "/usr/lib/x"},
        {"name": volume.name, "path": "/opt/cloche"},
        {"name": volume.name, "path": "/home/user"},
        {"name": volume.name, "read_only": "yes"},
    ):
        refused = alice.post("/v1/sessions", json={"volumes": [mount]})
        assert refused.status_code == 400, (mount, refused.text)
    twice = [{"name": volume.name, "path": "/mnt/a"}, {"name": volume.name, "path": "/mnt/a"}]
    assert alice.post("/v1/sessions", json={"volumes": twice}).status_code == 400
    missing = alice.post("/v1/sessions", json={"volumes": [{"name": "no-such-volume"}]})
    assert missing.status_code == 404
    assert "Volume no-such-volume not found" in missing.json()["error"]["message"]
    assert alice.get("/v1/sessions").json()["sessions"] == []  # nothing was left started


def test_the_default_path_is_mnt_and_the_session_says_what_it_mounts(volume: Volume) -> None:
    made = volume.client.post("/v1/sessions", json={"volumes": [{"name": volume.name}]})
    volume.sessions.append(made.json()["id"])
    assert made.json()["volumes"] == [
        {"name": volume.name, "path": f"/mnt/{volume.name}", "read_only": False}
    ]
    assert volume.value(made.json()["id"], f"import os; os.path.ismount('/mnt/{volume.name}')")


def test_a_data_session_mounts_a_volume_too(volume: Volume) -> None:
    """The data profile's sandboxes are restored from its checkpoint: the volume is a mount
    the checkpoint did not have."""
    session_id = volume.session(profile="data")
    assert (
        volume.value(
            session_id,
            "import pandas; pandas.DataFrame({'a': [1]}).to_csv('/home/user/data/a.csv')",
        )
        is None
    )
    assert b"a" in volume.client.get(f"/v1/volumes/{volume.name}/files/a.csv").content


def test_events_and_metrics_count_volumes(alice: httpx.Client, server: ServerThread) -> None:
    first_id = server.server.events.next_id
    Volume(alice, "counted", size_mib=4).close()
    kinds = [
        (event.type, event.data.get("name"))
        for event in list(server.server.events._buffer)
        if event.id >= first_id and event.type.startswith("volume.")
    ]
    assert kinds == [("volume.created", "counted"), ("volume.deleted", "counted")]
    made = Volume(alice, "gauged", size_mib=4)
    try:
        text = alice.get("/metrics").text
        assert "cloche_volumes " in text and "cloche_volume_bytes " in text
        volumes = {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("cloche_volume")
        }
        assert volumes["cloche_volumes"] >= 1
        assert volumes["cloche_volume_bytes"] >= 4 * 2**20
    finally:
        made.close()


def test_a_restarted_server_finds_its_volumes_and_its_sessions_mount_them_again(
    make_server: Any, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    first = make_server(pool_size=1, data_dir=data_dir)
    with httpx.Client(base_url=f"http://127.0.0.1:{first.http_port}", timeout=300) as client:
        kept = Volume(client, "kept", size_mib=8)
        session_id = kept.session()
        kept.value(session_id, "x = 'state'; open('/home/user/data/f', 'w').write('before'); 0")
    first.stop()  # the session is paused, its sandbox and the volume's mount gone
    assert mounts.mounts_under(data_dir) == []
    assert loop_devices_of(first) == []
    second = make_server(pool_size=1, data_dir=data_dir)
    with httpx.Client(base_url=f"http://127.0.0.1:{second.http_port}", timeout=300) as client:
        kept.client = client
        assert [v["name"] for v in client.get("/v1/volumes").json()["volumes"]] == ["kept"]
        assert client.get("/v1/volumes/kept/files/f").content == b"before"
        assert client.put("/v1/volumes/kept/files/g", content=b"meanwhile").status_code == 204
        seen = kept.value(
            session_id, "[x, open('/home/user/data/f').read(), open('/home/user/data/g').read()]"
        )
        assert seen == ["state", "before", "meanwhile"]
        kept.close()


def test_a_tenants_quota_covers_its_volumes(make_server: Any, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens.carol]\ntoken = "carol"\nmax_volume_bytes = {12 * 2**20}\n')
    tokens.chmod(0o600)
    quota = make_server(pool_size=0, tokens_file=tokens, quota_wait_s=60.0)
    with api(quota, "carol") as carol:
        too_large = carol.post("/v1/volumes", json={"name": "huge", "size_mib": 13})
        assert too_large.status_code == 429  # more than the quota allows at all: at once
        assert "max_volume_bytes" in too_large.json()["error"]["message"]
        first = Volume(carol, "first", size_mib=8)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(carol.post, "/v1/volumes", json={"name": "second", "size_mib": 8})
            deadline = time.monotonic() + 60
            while not any(e.type == "quota.exceeded" for e in quota.server.events._buffer):
                assert time.monotonic() < deadline, "the second creation never waited"
                time.sleep(0.05)
            assert not waiting.done()
            first.close()  # its deletion makes room: the waiting creation goes on
            assert waiting.result(timeout=120).status_code == 201
        assert carol.delete("/v1/volumes/second").status_code == 204


def test_the_sdk_makes_mounts_and_reaches_volumes(server: ServerThread) -> None:
    url = f"http://127.0.0.1:{server.http_port}"
    with cloche.Client(url, ALICE, timeout_s=300) as client, cloche.Client(url, BOB) as other:
        made = client.create_volume("sdk", size_mib=4)
        assert (made.name, made.size_mib, made.sessions) == ("sdk", 4, ())
        try:
            client.upload_to_volume("sdk", "in/data.txt", "from the sdk")
            with client.create_session(volumes=["sdk"]) as session:
                assert session.info.volumes == [
                    {"name": "sdk", "path": "/mnt/sdk", "read_only": False}
                ]
                out = session.run("print(open('/mnt/sdk/in/data.txt').read())")
                assert out.logs.stdout == "from the sdk\n"
                session.run("open('/mnt/sdk/out.txt', 'w').write('from inside')")
                assert client.volume("sdk").sessions == (session.id,)
                with pytest.raises(cloche.VolumeInUse):
                    client.delete_volume("sdk")
            with client.create_session(
                volumes=[{"name": "sdk", "path": "/srv/ro", "read_only": True}]
            ) as reader:
                attempt = reader.run(
                    "import errno\ntry:\n    open('/srv/ro/x', 'w')\n"
                    "except OSError as e:\n    print(errno.errorcode[e.errno])"
                )
                assert attempt.logs.stdout == "EROFS\n"
            assert client.download_from_volume("sdk", "out.txt") == b"from inside"
            assert [f.path for f in client.volume_files("sdk")] == ["in/data.txt", "out.txt"]
            assert [v.name for v in client.volumes()] == ["sdk"]
            with pytest.raises(cloche.VolumeFull):
                client.upload_to_volume("sdk", "big", b"x" * 5 * 2**20)
            with pytest.raises(cloche.PathRefused):
                client.download_from_volume("sdk", "../../etc/passwd")
            with pytest.raises(cloche.PathNotFound):
                client.download_from_volume("sdk", "missing")
            client.delete_from_volume("sdk", "in")
            assert [f.path for f in client.volume_files("sdk")] == ["out.txt"]
            with pytest.raises(cloche.VolumeNotFound, match="Volume sdk not found"):
                other.volume("sdk")
            with pytest.raises(cloche.VolumeNotFound):
                other.create_session(volumes=["sdk"])
            with pytest.raises(cloche.VolumeExists):
                client.create_volume("sdk", size_mib=4)
            with pytest.raises(cloche.VolumeRefused):
                client.create_session(volumes=[{"name": "sdk", "path": "/proc/x"}])
        finally:
            client.delete_volume("sdk")
        with pytest.raises(cloche.VolumeNotFound):
            client.delete_volume("sdk")


def test_a_crashed_server_leaves_nothing_mounted_that_the_next_one_cannot_clean(
    tmp_path: Path,
) -> None:
    state, data = tmp_path / "state", tmp_path / "data"
    settings = ("--data-dir", str(data), "--data-pool-size", "0")
    first = ServerProcess(state, *settings)
    with httpx.Client(base_url=f"http://127.0.0.1:{first.http_port}", timeout=300) as client:
        kept = Volume(client, "crash", size_mib=8)
        kept.value(kept.session(), "open('/home/user/data/f', 'w').write('before the crash'); 0")
        kept.value(kept.session(path="/mnt/ro", read_only=True), "0")
    assert len(mounts.mounts_under(data / "volumes")) == 2  # the volume, its read-only view
    first.stop(signal.SIGKILL)
    second = ServerProcess(state, *settings)
    try:
        assert leftovers(state, first.instance) == NOTHING_LEFT
        assert mounts.mounts_under(data / "volumes") == []
        with httpx.Client(base_url=f"http://127.0.0.1:{second.http_port}", timeout=300) as client:
            kept.client, kept.sessions = client, []
            reader = kept.session(read_only=True)
            assert kept.value(reader, "open('/home/user/data/f').read()") == "before the crash"
            kept.close()
    finally:
        assert second.stop() == 0
    assert loop_devices_under(data) == []
    assert mounts.mounts_under(data) == []
