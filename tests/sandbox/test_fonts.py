"""matplotlib's font list ships built with the runtime: a session's first plot reads it, in
real gVisor, instead of scanning every font (seconds under load)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloche.config import Limits
from cloche.sandbox import fonts
from cloche.sessions.result import CellStatus
from support import NEVER_BEHIND_SLICE_S, RUNTIME_DIR, ServerThread, make_config, require_gvisor

# What matplotlib logs as it loads its font list, a plot drawn with text, and where the
# list the session read lives.
FIRST_PLOT = """
import json, logging, os
told = []
class Keep(logging.Handler):
    def emit(self, record):
        told.append(record.getMessage())
logger = logging.getLogger("matplotlib.font_manager")
logger.addHandler(Keep())
logger.setLevel(logging.DEBUG)
import matplotlib.pyplot as plt
plt.plot([1, 3, 2]); plt.title("fonts"); plt.xlabel("x")
plt.gcf().canvas.draw()
plt.show()
config = os.environ["MPLCONFIGDIR"]
lists = [os.path.join(config, n) for n in os.listdir(config) if n.startswith("fontlist-")]
print(json.dumps({
    "told": [m for m in told if not m.startswith("findfont: score")],
    "lists": {p: os.path.realpath(p) for p in lists},
    "writable": [os.access(os.path.realpath(p), os.W_OK) for p in lists],
}))
"""


@pytest.fixture(scope="module")
def server(state_root) -> Iterator[ServerThread]:
    require_gvisor()
    limits = Limits(cell_timeout_s=300.0, interrupt_grace_s=1.0)  # a loaded machine
    config = make_config(state_root, pool_size=1, limits=limits, cell_slice_s=NEVER_BEHIND_SLICE_S)
    with ServerThread(config) as running:
        yield running


def test_a_fresh_sessions_first_plot_reads_the_shipped_font_list(server):
    manager = server.server.manager
    info = server.call(manager.create())
    result = server.call(manager.execute(info.id, FIRST_PLOT), timeout_s=330)
    assert result.status is CellStatus.OK, result
    seen = json.loads(result.stdout)
    ((linked, shipped),) = seen["lists"].items()
    loaded = [m for m in seen["told"] if "fontManager" in m]
    assert loaded == [f"Using fontManager instance from {linked}"], seen["told"]
    assert not [m for m in seen["told"] if "Rebuilding" in m or "Could not save" in m]
    assert shipped.startswith("/opt/cloche/site-packages/.cloche/matplotlib/fontlist-v")
    assert seen["writable"] == [False]  # read-only, from the runtime's mount
    assert [d for d in result.displays if "image/png" in d]
    server.call(manager.close(info.id))


@pytest.fixture
def runtime_copy(tmp_path: Path) -> Path:
    """A runtime of links to the real one's packages (and nothing built yet)."""
    copy = tmp_path / "site-packages"
    copy.mkdir()
    for entry in RUNTIME_DIR.iterdir():
        if entry.name != ".cloche":
            (copy / entry.name).symlink_to(entry)
    return copy


def test_the_list_holds_only_fonts_a_sandbox_can_open(runtime_copy: Path):
    built = fonts.build(runtime_copy)
    assert built is not None and built.parent == fonts.shipped_dir(runtime_copy)
    listed = json.loads(built.read_text())
    names = [entry["fname"] for kind in ("ttflist", "afmlist") for entry in listed[kind]]
    assert "fonts/ttf/DejaVuSans.ttf" in names  # matplotlib's own, relative to its data
    assert all(name.startswith("/usr/") or not name.startswith("/") for name in names)
    assert oct(built.stat().st_mode & 0o777) == oct(0o644)


def test_a_runtime_without_matplotlib_gets_no_list(tmp_path: Path):
    assert fonts.build(tmp_path) is None
    assert not fonts.shipped_dir(tmp_path).exists()
