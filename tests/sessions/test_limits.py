"""Limits and interrupts of a cell, against real gVisor (see the execution spec)."""

from __future__ import annotations

import logging

import pytest

from cloche.config import Limits
from support import ServerThread, make_config, require_gvisor


@pytest.fixture(scope="module")
def tight(state_root):
    """A server with small limits, shared by this module."""
    require_gvisor()
    limits = Limits(
        cell_timeout_s=20.0,
        interrupt_grace_s=1.0,
        memory_mib=512,
        output_bytes=10_000,
        disk_mib=16,
        nproc=32,
    )
    with ServerThread(make_config(state_root, limits=limits, pool_size=2)) as running:
        yield running


def test_timeout_interrupts_and_the_session_keeps_its_state(tight):
    with tight.client() as c:
        sid = c.run("kept = 'state'")["session_id"]
        reply = c.run("while True: pass", sid, timeout_s=2)
        assert reply["status"] == "error"
        assert reply["cell_status"] == "timeout"
        assert "time limit of 2 s" in reply["error"]
        assert "session survived" in reply["error"]
        assert "KeyboardInterrupt" in reply["error"]
        assert c.run("kept", sid)["output"] == "'state'\n"


def test_sleep_is_interrupted_by_the_timeout(tight):
    with tight.client() as c:
        reply = c.run("import time\nprint('start')\ntime.sleep(100)", timeout_s=1)
        assert reply["cell_status"] == "timeout"
        assert reply["output"] == "start\n"


def test_cell_that_ignores_sigint_is_killed_and_its_session_is_gone(tight):
    with tight.client() as c:
        sid = c.run("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n1")["session_id"]
        reply = c.run("while True: pass", sid, timeout_s=1)
        assert reply["status"] == "error"
        assert reply["cell_status"] == "killed"
        assert reply["session_alive"] is False
        assert "time limit of 1 s" in reply["error"]
        assert "did not stop within 1 s of the interrupt" in reply["error"]
        assert "session is gone" in reply["error"]
        after = c.run("1", sid)
        assert after == {"status": "error", "error": f"Session {sid} not found"}


def test_memory_error_leaves_the_session_alive(tight):
    with tight.client() as c:
        sid = c.run("before = 1")["session_id"]
        reply = c.run("x = bytearray(2 * 1024**3)", sid)
        assert reply["status"] == "error"
        assert "MemoryError" in reply["error"]
        assert "memory limit of 512 MiB" in reply["error"]
        assert c.run("before", sid)["output"] == "1\n"


def test_output_beyond_the_limit_is_dropped_with_a_marker(tight):
    with tight.client() as c:
        reply = c.run("print('x' * 50_000)")
        assert reply["status"] == "ok"
        assert reply["output"].startswith("x" * 10_000)
        assert "40001 bytes of output dropped" in reply["output"]
        assert len(reply["output"]) < 10_100


def test_a_huge_or_unencodable_last_value_is_shown_cut_and_the_session_survives(tight):
    with tight.client() as c:
        # A 20 MiB string (more than a frame may carry as JSON) and an int too long to print.
        reply = c.run("s = 'x' * (20 << 20)\ns")
        sid = reply["session_id"]
        assert reply["status"] == "ok" and reply["cell_status"] == "ok", reply
        assert reply["output"].startswith("'xxx") and len(reply["output"]) < 11_000
        reply = c.run("n = 10 ** 5000\nn", sid)
        # Its repr raises: the user's error, reported as such.
        assert reply["status"] == "error" and "ValueError" in reply["error"], reply
        assert c.run("len(s), n.bit_length()", sid)["output"] == "(20971520, 16610)\n"


def test_process_limit_stops_a_fork_bomb_and_the_session_survives(tight):
    code = (
        "import os\n"
        "pids = []\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            import time; time.sleep(30); os._exit(0)\n"
        "        pids.append(pid)\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
        "for pid in pids:\n"
        "    os.kill(pid, 9); os.waitpid(pid, 0)\n"
        "len(pids) < 200"
    )
    with tight.client() as c:
        reply = c.run(code)
        assert reply["status"] == "ok", reply
        assert reply["output"] == "BlockingIOError\nTrue\n"


def test_disk_limit_gives_enospc_in_the_working_directory_and_tmp(tight):
    code = (
        "import errno\n"
        "def fill(path):\n"
        "    try:\n"
        "        with open(path, 'wb') as f:\n"
        "            for _ in range(64):\n"
        "                f.write(b'\\0' * 1024 * 1024)\n"
        "    except OSError as exc:\n"
        "        return exc.errno in (errno.ENOSPC, errno.EFBIG)\n"
        "    return False\n"
        "fill('big'), fill('/tmp/big')"
    )
    with tight.client() as c:
        reply = c.run(code)
        assert reply["output"] == "(True, True)\n", reply


def test_cells_queue_in_order_in_one_session(tight):
    import threading

    with tight.client() as c:
        sid = c.run("log = []")["session_id"]
    replies: dict[int, dict[str, str]] = {}

    def send(i: int) -> None:
        with tight.client() as conn:
            replies[i] = conn.run(f"import time; time.sleep(0.05); log.append({i})", sid)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r["status"] == "ok" for r in replies.values())
    with tight.client() as c:
        assert sorted(eval(c.run("log", sid)["output"])) == [0, 1, 2, 3, 4]  # noqa: S307


def test_routine_cells_are_logged_at_debug_and_limited_ones_at_info(tight, caplog):
    """A line per cell at info level costs a busy server ~10% of its CPU; a cell stopped
    by its time limit is still worth an operator's eye."""
    caplog.set_level(logging.DEBUG, logger="cloche.session")
    with tight.client() as c:
        sid = c.run("1")["session_id"]
        c.run("1 / 0", sid)
        assert c.run("import time; time.sleep(100)", sid, timeout_s=1)["cell_status"] == "timeout"
    lines = {
        r.getMessage().split()[2]: r.levelno
        for r in caplog.records
        if r.name == "cloche.session" and r.getMessage().startswith(f"cell session={sid} ")
    }
    assert lines == {
        "status=ok": logging.DEBUG,
        "status=error": logging.DEBUG,
        "status=timeout": logging.INFO,
    }
