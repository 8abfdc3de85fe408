"""Attacks on the kernel's channel to the host, from inside the kernel's own process."""

from __future__ import annotations

FORGE = (
    "import json, os, struct\n"
    "def frame(message):\n"
    "    body = json.dumps(message).encode()\n"
    "    return struct.pack('>I', len(body)) + body\n"
    "forged = frame({'op': 'done', 'status': 'ok', 'result': {'data': {'text/plain': 'FORGED'}}})\n"
)


def test_forged_frames_on_stdout_and_stderr_are_only_output(attacker, witness):
    """Write well-formed kernel frames to fds 1 and 2. Outcome: they arrive as plain output."""
    with witness.watching():
        reply = attacker.run(FORGE + "os.write(1, forged); os.write(2, forged); 'real'")
    assert reply["status"] == "ok"
    assert str(reply["output"]).endswith("'real'\n")
    assert attacker.value("'next'") == "'next'\n"


def test_forged_frames_on_every_fd_end_only_that_session(attacker, witness):
    """Write a forged end-of-cell frame, then garbage, to every open fd (the channel among
    them). Outcome: the host sees a broken protocol and kills that sandbox, with a clear
    error. A forged end-of-cell that arrives before the garbage can only fake the result of
    the forger's own cell; the session is gone either way."""
    code = FORGE + (
        "for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "    for data in (forged, b'\\xff' * 64, struct.pack('>I', 2**31)):\n"
        "        try: os.write(fd, data)\n"
        "        except OSError: pass\n"
        "import time; time.sleep(5)"
    )
    with witness.watching():
        reply = attacker.run(code)
    if reply["cell_status"] == "killed":
        assert "broke the channel protocol" in str(reply["error"])
    else:
        assert str(reply["output"]).endswith("FORGED\n")
    assert attacker.run("1")["error"] == f"Session {attacker.session_id} not found"


def test_flooding_the_channel_ends_only_that_session(attacker, witness):
    """Write stream frames far beyond the output limit straight into the channel.
    Outcome: the host stops believing the kernel and kills its sandbox."""
    code = (
        "import json, os, struct\n"
        "body = json.dumps({'op': 'stream', 'name': 'stdout', 'text': 'z' * 60000}).encode()\n"
        "frame = struct.pack('>I', len(body)) + body\n"
        "fds = [int(fd) for fd in os.listdir('/proc/self/fd') if int(fd) > 2]\n"
        "for _ in range(200):\n"
        "    for fd in fds:\n"
        "        try: os.write(fd, frame)\n"
        "        except OSError: pass\n"
        "import time; time.sleep(5)"
    )
    with witness.watching():
        reply = attacker.run(code)
    assert reply["cell_status"] == "killed", reply
    assert len(str(reply.get("output", ""))) <= 101_000


def test_closing_stdout_and_stderr_does_not_break_the_session(attacker, witness):
    """Close fds 1 and 2 and sys.stdout. Outcome: that cell loses its output; the next cell
    has working stdout and stderr again."""
    with witness.watching():
        attacker.run("import os, sys\nos.close(1); os.close(2)\nsys.stdout.close()\n'x'")
        reply = attacker.run("import sys\nprint('out'); print('err', file=sys.stderr); 3")
    assert reply["status"] == "ok"
    assert reply["output"] == "out\nerr\n3\n"


def test_killing_its_own_kernel_is_reported_cleanly(attacker, witness, secure_server):
    """SIGKILL the kernel (pid 1 of the sandbox). Outcome: 'killed', the session is gone,
    the server and other sessions go on."""
    with witness.watching():
        reply = attacker.run("import os, signal; os.kill(1, signal.SIGKILL)")
    assert reply["cell_status"] == "killed"
    assert reply["session_alive"] is False
    assert "killed by SIGKILL: by its own code" in str(reply["error"])
    assert attacker.run("1")["error"] == f"Session {attacker.session_id} not found"
    with secure_server.client() as c:
        assert c.run("40 + 2")["output"] == "42\n"


def test_exiting_the_interpreter_is_an_error_not_a_crash(attacker, witness):
    """exit(), sys.exit() and raise SystemExit. Outcome: an error in the cell; the session
    lives (os._exit, which can't be caught, ends the session like a kill)."""
    with witness.watching():
        replies = [attacker.run(code) for code in ("exit()", "import sys; sys.exit(3)")]
        gone = attacker.run("import os; os._exit(0)")
    assert all(r["status"] == "error" and "SystemExit" in str(r["error"]) for r in replies)
    assert gone["cell_status"] == "killed"
