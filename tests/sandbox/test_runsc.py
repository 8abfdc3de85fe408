"""The runsc command wrapper: a command that hangs is a failure, not an exception."""

from __future__ import annotations

import time
from pathlib import Path

from cloche.sandbox.runsc import Runsc


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
