"""Attacks that try to exhaust the host: processes, threads, memory, disk, fds, output, CPU."""

from __future__ import annotations

import re

from support import ServerThread


def test_fork_bomb_is_contained(attacker, witness):
    """Fork without end. Outcome: BlockingIOError at the process limit; the session lives."""
    code = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(20); os._exit(0)\n"
        "        children += 1\n"
        "except OSError as exc:\n"
        "    stopped = type(exc).__name__\n"
        "os.killpg(0, 0) if False else None\n"
        "stopped, children < 64"
    )
    with witness.watching():
        output = attacker.value(code)
    assert output == "('BlockingIOError', True)\n"
    assert attacker.value("'alive'") == "'alive'\n"


def test_thread_bomb_is_contained(attacker, witness):
    """Start threads without end. Outcome: RuntimeError at the limit; the session lives."""
    code = (
        "import threading, time\n"
        "stop = threading.Event()\n"
        "threads = []\n"
        "try:\n"
        "    while True:\n"
        "        t = threading.Thread(target=stop.wait); t.start(); threads.append(t)\n"
        "except RuntimeError as exc:\n"
        "    error = type(exc).__name__\n"
        "stop.set()\n"
        "for t in threads: t.join()\n"
        "error, len(threads) < 64"
    )
    with witness.watching():
        output = attacker.value(code)
    assert output == "('RuntimeError', True)\n"


def test_memory_bomb_gives_memory_error(attacker, witness):
    """Allocate far beyond the memory limit, at once and bit by bit.
    Outcome: MemoryError; the session and its state survive."""
    with witness.watching():
        attacker.value("kept = 'state'")
        big = attacker.run("x = bytearray(4 * 1024**3)")
        creep = attacker.run("chunks = []\nwhile True: chunks.append(bytearray(16 * 1024**2))")
    for reply in (big, creep):
        assert reply["status"] == "error"
        assert "MemoryError" in str(reply["error"])
        assert "memory limit of 512 MiB" in str(reply["error"])
    assert attacker.value("del chunks; kept") == "'state'\n"


def test_memory_bomb_across_processes_kills_only_its_own_sandbox(attacker, witness):
    """Many processes, each filling memory just under the rlimit, together past the cgroup.
    Outcome: the cgroup backstop kills that sandbox only; the client hears 'killed'."""
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
    with witness.watching():
        reply = attacker.run(code)
    assert reply["cell_status"] == "killed", reply
    assert reply["session_alive"] is False
    assert "memory backstop of 672 MiB" in str(reply["error"])
    assert "session is gone" in str(reply["error"])


def test_disk_fill_gives_enospc(attacker, witness):
    """Fill the working directory and /tmp. Outcome: ENOSPC (or EFBIG) at the disk limit."""
    code = (
        "import errno\n"
        "def fill(path):\n"
        "    try:\n"
        "        with open(path, 'wb') as f:\n"
        "            while True: f.write(b'\\0' * 1024 * 1024)\n"
        "    except OSError as exc:\n"
        "        return errno.errorcode[exc.errno]\n"
        "fill('/work/fill'), fill('/tmp/fill')"
    )
    with witness.watching():
        output = attacker.value(code)
    assert output in ("('ENOSPC', 'ENOSPC')\n", "('EFBIG', 'EFBIG')\n", "('ENOSPC', 'EFBIG')\n")


def test_fd_exhaustion_gives_emfile(attacker, witness):
    """Open files without end. Outcome: EMFILE at the limit; the session still works."""
    code = (
        "import errno, os\n"
        "fds = []\n"
        "try:\n"
        "    while True: fds.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError as exc:\n"
        "    error = errno.errorcode[exc.errno]\n"
        "for fd in fds: os.close(fd)\n"
        "error, len(fds) < 1024"
    )
    with witness.watching():
        output = attacker.value(code)
    assert output == "('EMFILE', True)\n"
    assert attacker.value("print('still talking'); 1") == "still talking\n1\n"


def test_huge_output_is_truncated(attacker, witness):
    """Print 20 MB of lines from Python and 200 MB without newlines to fd 1.
    Outcome: kept to the output limit with a marker saying how much was dropped."""
    with witness.watching():
        lines = attacker.run("for _ in range(20_000): print('x' * 1000)")
        raw = attacker.run("import os\nfor _ in range(2000): os.write(1, b'y' * 100_000)")
    for reply in (lines, raw):
        assert reply["status"] == "ok"
        output = str(reply["output"])
        assert 100_000 <= len(output) < 101_000
        assert "bytes of output dropped" in output


def test_cpu_spin_in_many_threads_is_stopped_by_the_timeout(attacker, witness):
    """Spin the CPU in many threads. Outcome: the timeout interrupts the cell; the session
    lives; the witness stays responsive."""
    # The threads are started inside the try: starting 16 threads while the others spin
    # can outlast the time limit on a busy machine, and an interrupt that landed before the
    # try left them spinning for good, the kernel starved of its GIL, the sandbox killed
    # (the full suite failed so about one run in three; by hand, with a 20 s grace, too).
    code = (
        "import threading\n"
        "def spin():\n"
        "    while not done: pass\n"
        "done = False\n"
        "try:\n"
        "    for _ in range(16): threading.Thread(target=spin, daemon=True).start()\n"
        "    spin()\n"
        "finally:\n"
        "    done = True"
    )
    with witness.watching():
        reply = attacker.run(code, timeout_s=3)
    assert reply["cell_status"] == "timeout", reply
    assert attacker.value("done") == "True\n"


def test_sleep_forever_is_stopped_by_the_timeout(attacker, witness):
    """Sleep forever. Outcome: interrupted at the time limit; the session lives."""
    with witness.watching():
        reply = attacker.run("import time; time.sleep(10**6)", timeout_s=1)
    assert reply["cell_status"] == "timeout"
    assert attacker.value("1") == "1\n"


def test_ignoring_sigint_gets_the_sandbox_killed(attacker, witness):
    """Ignore SIGINT and loop. Outcome: killed after the grace period; the session is gone,
    and the next request says so."""
    with witness.watching():
        reply = attacker.run(
            "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass",
            timeout_s=1,
        )
    assert reply["cell_status"] == "killed"
    assert re.search(r"did not stop within [\d.]+ s of the interrupt", str(reply["error"]))
    assert attacker.run("1")["error"] == f"Session {attacker.session_id} not found"


def test_c_level_loop_that_never_checks_signals_is_killed(attacker, witness):
    """Loop in C without returning to Python (any() over an endless iterator).
    Outcome: the interrupt can't land, so the sandbox is killed after the grace period."""
    with witness.watching():
        reply = attacker.run("import itertools\nany(itertools.repeat(0))", timeout_s=1)
    assert reply["cell_status"] == "killed"
    assert "time limit of 1 s" in str(reply["error"])


def test_catastrophic_regex_is_interrupted(attacker, witness):
    """A regex with exponential backtracking. Outcome: interrupted at the time limit
    (the regex engine checks for signals); the session lives."""
    with witness.watching():
        reply = attacker.run("import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')", timeout_s=1)
    assert reply["cell_status"] in ("timeout", "killed")
    if reply["cell_status"] == "timeout":
        assert attacker.value("2") == "2\n"


def test_pool_refills_after_sandboxes_are_killed(secure_server: ServerThread, attacker):
    """Kill its own sandbox to drain the warm pool. Outcome: new sessions still start, from a
    refilled pool."""
    attacker.run("import os; os.kill(os.getpid(), 9)")
    with secure_server.client() as c:
        assert c.run("'fresh'")["output"] == "'fresh'\n"
