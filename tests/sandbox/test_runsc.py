"""The runsc command wrapper: a command that hangs is a failure, not an exception; what
runsc said before it ended."""

from __future__ import annotations

import time
from pathlib import Path

from cloche.sandbox.runsc import Runsc, last_words


def test_a_runsc_command_that_hangs_is_killed_and_reported_as_failed(tmp_path: Path) -> None:
    hanging = tmp_path / "runsc"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(0o755)
    runsc = Runsc(str(hanging), tmp_path / "root")
    started = time.monotonic()
    done = runsc._call("kill", "some-id", "KILL", timeout_s=0.3)
    assert time.monotonic() - started < 30
    assert done.returncode != 0
    assert done.stderr == "runsc kill did not finish within 0.3 s"


def test_last_words_are_a_go_crash_s_first_lines_else_the_log_s_end(tmp_path: Path) -> None:
    panic_log, stderr = tmp_path / "panic.log", tmp_path / "runsc.log"
    assert last_words(panic_log, stderr) == ""  # neither was written
    stderr.write_text("W1207 starting\n" + "x" * 3000 + "\nlast line\n")
    assert last_words(panic_log, stderr).endswith("last line")
    assert len(last_words(panic_log, stderr)) == 2000
    dump = "\n".join(f"goroutine {n} [select]:\n\tframe" for n in range(500))
    panic_log.write_text(f"runtime: failed to create new OS thread\nfatal error: newosproc\n{dump}")
    said = last_words(panic_log, stderr)
    assert said.startswith("fatal error: newosproc\ngoroutine 0 [select]") and len(said) == 1000
