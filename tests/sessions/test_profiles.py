"""Session profiles (lean, data) and rich output from the kernel, against real gVisor."""

from __future__ import annotations

import base64

import pytest

from cloche.config import Limits
from cloche.errors import UnknownProfile
from cloche.sessions.result import CellStatus
from support import NEVER_BEHIND_SLICE_S, ServerThread, make_config, require_gvisor

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# These tests are about what cells produce, not about time limits nor CPU placement: at a
# load of 20-28 on 2 cores, two plots in a data session took 20-60 s (the 20 s limit killed
# the cell), mostly behind the host's processes (support.NEVER_BEHIND_SLICE_S).
CELL_TIMEOUT_S = 300.0
WAIT_S = CELL_TIMEOUT_S + 60  # for a cell, or a session from a pool being refilled

pytestmark = pytest.mark.timeout(4 * WAIT_S)


@pytest.fixture(scope="module")
def both(state_root):
    require_gvisor()
    limits = Limits(cell_timeout_s=CELL_TIMEOUT_S, interrupt_grace_s=1.0)
    config = make_config(
        state_root,
        pool_size=1,
        data_pool_size=1,
        limits=limits,
        cell_slice_s=NEVER_BEHIND_SLICE_S,
    )
    with ServerThread(config) as running:
        running.call(running.server.manager.pools["data"].wait_full(WAIT_S), timeout_s=WAIT_S)
        yield running


def create(server, profile="lean"):
    return server.call(server.server.manager.create(profile=profile), timeout_s=WAIT_S)


def run(server, session_id, code):
    return server.call(server.server.manager.execute(session_id, code), timeout_s=WAIT_S)


def test_data_sessions_start_with_the_data_stack_imported(both):
    info = create(both, "data")
    assert info.profile == "data"
    before = run(
        both,
        info.id,
        "import sys; sorted(m for m in ('numpy', 'pandas', 'scipy', "
        "'sympy', 'matplotlib.pyplot') if m in sys.modules)",
    )
    assert before.result_text == "['matplotlib.pyplot', 'numpy', 'pandas', 'scipy', 'sympy']"
    # The preloading left nothing in the user's namespace and counted no cell.
    names = run(both, info.id, "sorted(k for k in globals() if not k.startswith('_'))")  # noqa: E501
    # sys: imported by the cell before; get_ipython: the shell, as IPython's namespace has it
    assert names.result_text == "['get_ipython', 'sys']"
    assert names.execution_count == 2
    assert both.server.manager.pools["data"].hits >= 1


def test_lean_sessions_import_nothing_ahead(both):
    info = create(both)
    result = run(both, info.id, "import sys; 'pandas' in sys.modules, 'numpy' in sys.modules")
    assert result.result_text == "(False, False)"


def test_an_unknown_profile_is_refused_clearly(both):
    with pytest.raises(UnknownProfile, match="choose one of data, lean"):
        both.call(both.server.manager.create(profile="gpu"))


def test_new_session_over_tcp_may_ask_for_the_data_profile(both):
    with both.client() as c:
        reply = c.request({"code": "import sys; 'pandas' in sys.modules", "profile": "data"})
        assert reply["output"] == "True\n"


def test_matplotlib_figures_become_png_displays_in_order(both):
    info = create(both, "data")
    code = (
        "import matplotlib.pyplot as plt\n"
        "print('before')\n"
        "plt.plot([1, 2, 3]); plt.show()\n"
        "display('between')\n"
        "plt.figure(); plt.bar(['a'], [1])\n"
        "'result'"
    )
    result = run(both, info.id, code)
    assert result.status is CellStatus.OK
    assert result.stdout == "before\n"
    kinds = [("png" if "image/png" in d else d["text/plain"]) for d in result.displays]
    assert kinds == ["png", "'between'", "png"]
    for display in (result.displays[0], result.displays[2]):
        assert base64.b64decode(display["image/png"]).startswith(PNG_MAGIC)
    assert result.result_text == "'result'"
    # Shown figures are closed: the next cell starts with none open.
    assert run(both, info.id, "plt.get_fignums()").result_text == "[]"


def test_rich_reprs_are_part_of_the_result(both):
    info = create(both, "data")
    result = run(both, info.id, "import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert "<table" in result.result["data"]["text/html"]
    assert "a" in result.result["data"]["text/plain"]
    assert "json" not in result.result
    native = run(both, info.id, "{'a': [1, 2.5, 'x', None, True]}")
    assert native.result["json"] == {"a": [1, 2.5, "x", None, True]}
