"""--freeze-idle: an idle session's sandbox is frozen (no CPU at all), and its next cell,
interrupt or close thaws it with its state intact."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from cgroup_support import freezer_state as state_of
from cgroup_support import group_dir, sandbox_freezer_state
from cgroup_support import sandbox_pids as pids_of
from cloche.config import Limits
from cloche.sandbox import cgroups
from cloche.sessions import session
from support import NOTHING_LEFT, ServerProcess, leftovers, require_gvisor, slowness

# Waits scale with this machine's slowness (support.slowness); so does what an idle
# sandbox costs: its own ticks take 2-3% of a core here, 30-40% on an emulated CPU, where a
# look at it would take it for one busy on its own (BUSY_SHARE) and never freeze it. There
# the threshold rises with the slowness, up to 60% of a core: a spinning thread takes a core.
SLOW = slowness()


@pytest.fixture(autouse=True)
def idle_as_this_machine_idles(monkeypatch):
    monkeypatch.setattr(session, "BUSY_SHARE", min(0.6, session.BUSY_SHARE * SLOW))


def freezer_state(instance: str, sandbox_id: str) -> str:
    """Its freezer's state (v2: of every group its processes may be in, behind included)."""
    return sandbox_freezer_state(instance, sandbox_id)


def wait_for_state(
    instance: str, sandbox_id: str, wanted: str, timeout_s: float = 20 * SLOW
) -> None:
    deadline = time.monotonic() + timeout_s
    while freezer_state(instance, sandbox_id) != wanted:
        assert time.monotonic() < deadline, f"the sandbox never became {wanted}"
        time.sleep(0.02)  # polling the cgroup, with a deadline


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


def sandbox_pids(instance: str, sandbox_id: str) -> list[int]:
    return pids_of(instance, sandbox_id)


class OneSession:
    """A server with one session, and where to look at its sandbox's cgroup."""

    def __init__(self, make_server, freeze_idle_s: float) -> None:
        self.server = make_server(pool_size=1, limits=Limits(freeze_idle_s=freeze_idle_s))
        self.manager = self.server.server.manager
        self.instance = self.server.server.backend.state.instance
        self.id = self.server.call(self.manager.create()).id
        self.sandbox_id = self.manager._sessions[self.id].kernel.id

    def run(self, code: str):
        return self.server.call(self.manager.execute(self.id, code))

    def state(self) -> str:
        return freezer_state(self.instance, self.sandbox_id)

    def wait_for(self, wanted: str) -> None:
        wait_for_state(self.instance, self.sandbox_id, wanted)

    def close(self) -> None:
        self.server.call(self.manager.close(self.id))


def test_an_idle_session_is_frozen_burns_nothing_and_thaws_with_its_state(make_server):
    one = OneSession(make_server, freeze_idle_s=0.2)
    assert one.run("x = 41").status.value == "ok"

    one.wait_for("FROZEN")
    pids = sandbox_pids(one.instance, one.sandbox_id)
    assert pids
    before = cpu_ticks(pids)
    time.sleep(1.0)  # an unfrozen idle sandbox burns a few ticks in a second here
    assert cpu_ticks(pids) == before

    assert one.run("x + 1").result_text == "42"
    assert one.state() == "THAWED"
    one.wait_for("FROZEN")  # idle again, frozen again
    one.close()
    assert not group_dir(cgroups.cgroups_path(one.instance, one.sandbox_id), "freezer").exists()


def test_a_session_busy_on_its_own_is_left_running_until_it_stops(make_server):
    one = OneSession(make_server, freeze_idle_s=0.2)
    spin = (
        "import threading\nspinning = True\n"
        "def spin():\n    while spinning:\n        pass\n"
        "threading.Thread(target=spin, daemon=True).start()"
    )
    assert one.run(spin).status.value == "ok"
    time.sleep(0.2 + 2 * session.FREEZE_PROBE_S + 0.5 * SLOW)  # two looks at its CPU use
    assert one.state() == "THAWED"

    assert one.run("spinning = False").status.value == "ok"
    one.wait_for("FROZEN")
    one.close()


def test_without_the_setting_nothing_is_frozen(make_server):
    one = OneSession(make_server, freeze_idle_s=0)
    assert one.run("1").status.value == "ok"
    time.sleep(0.2 + session.FREEZE_PROBE_S + 0.5 * SLOW)  # longer than the others' delays
    assert one.state() == "THAWED"
    one.close()


def test_frozen_sessions_of_a_killed_server_are_cleaned_up_by_the_next(tmp_path):
    require_gvisor()
    state_dir = tmp_path / "state"
    crashed = ServerProcess(state_dir, "--freeze-idle", "0.2")
    with crashed.client() as c:
        assert c.run("x = 1")["status"] == "ok"
    instance = crashed.instance
    try:
        group = f"{cgroups.tops()[0]}/{instance}"
        frozen = _frozen_in(group)
        deadline = time.monotonic() + 20 * SLOW
        while not frozen and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the freeze, with a deadline
            frozen = _frozen_in(group)
        if not frozen and SLOW > 1:
            # That server's own look takes an idle sandbox of a slow machine for a busy one
            # (see BUSY_SHARE above): freeze its sandboxes as it would have, for what the
            # next server must do.
            for sandbox in group_dir(group, "freezer").glob("*"):
                cgroups.set_frozen(f"{group}/{sandbox.name}", True)
            frozen = _frozen_in(group)
    finally:
        # Killed whatever happened above: a server left running would hold its sandboxes
        # and their mounts for the rest of the run.
        crashed.stop(signal.SIGKILL)
    successor = ServerProcess(state_dir)
    try:
        assert leftovers(state_dir, instance) == NOTHING_LEFT
    finally:
        successor.stop()
    assert frozen, "the idle session was never frozen"
    assert os.path.isdir(state_dir)


def _frozen_in(group: str) -> list[Path]:
    """The frozen sandboxes' cgroups under group. A cgroup removed while it is read (a
    sandbox that ended meanwhile, such as the start-up probe's) reads as ENODEV: not frozen."""
    frozen = []
    for sandbox in group_dir(group, "freezer").glob("*"):
        try:
            if state_of(f"{group}/{sandbox.name}") == "FROZEN":
                frozen.append(sandbox)
        except OSError:
            continue
    return frozen
