"""The session's site directory: on its kernel's sys.path, writable, on the disk limit."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cloche.config import Limits
from cloche.sandbox.bundle import SITE_MOUNT, USER_UID
from support import ServerThread

LIMITS = Limits(cell_timeout_s=20.0, interrupt_grace_s=1.0, disk_mib=16)


@pytest.fixture(scope="module")
def small_disk(state_root) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    from support import make_config, require_gvisor

    require_gvisor()
    with ServerThread(make_config(state_root, pool_size=1, limits=LIMITS)) as running:
        yield running


def sandbox_of(server: ServerThread, session_id: str):  # type: ignore[no-untyped-def]
    return server.server.manager._sessions[session_id].kernel.sandbox  # type: ignore[attr-defined]


def test_site_dir_is_on_sys_path_after_the_runtime_and_importable(small_disk):
    with small_disk.client() as client:
        reply = client.run(f"import sys; sys.path.index('{SITE_MOUNT}') > 0")
        assert reply["status"] == "ok", reply
        session = reply["session_id"]
        site = sandbox_of(small_disk, session).site_dir
        assert site is not None and site.is_dir()
        assert os.stat(site).st_uid == USER_UID
        (site / "planted.py").write_text("VALUE = 42\n")
        reply = client.run(
            "import importlib, planted, os\n"
            "runtime = [p for p in sys.path if p.endswith('site-packages')]\n"
            f"assert all(sys.path.index(p) < sys.path.index('{SITE_MOUNT}') for p in runtime)\n"
            f"planted.VALUE, os.access('{SITE_MOUNT}', os.W_OK), os.getcwd()",
            session_id=session,
        )
        assert reply["status"] == "ok", reply
        assert reply["output"].strip() == "(42, True, '/home/user')"


def test_site_dir_and_working_directory_share_the_disk_limit(small_disk):
    code = (
        "import errno, os\n"
        "def fill(path):\n"
        "    try:\n"
        "        with open(path, 'wb', buffering=0) as f:\n"
        "            for _ in range(64 * 16):\n"
        "                f.write(b'x' * (1 << 16))\n"
        "    except OSError as exc:\n"
        "        return errno.errorcode[exc.errno], os.stat(path).st_size >> 20\n"
        "    return 'no limit', 0\n"
        "first = fill('big')\n"
        f"second = fill('{SITE_MOUNT}/big')\n"
        "first, second"
    )
    with small_disk.client() as client:
        reply = client.run(code)
    assert reply["status"] == "ok", reply
    # The working directory takes the whole disk: the site directory has no room left.
    (first, first_mib), (second, second_mib) = eval(reply["output"])  # noqa: S307
    assert first in ("ENOSPC", "EFBIG") and first_mib >= 15
    assert second == "ENOSPC" and second_mib <= 1


def test_site_dir_is_removed_with_the_session(small_disk):
    with small_disk.client() as client:
        reply = client.run("1")
        session = reply["session_id"]
        sandbox = sandbox_of(small_disk, session)
        small_disk.call(small_disk.server.manager.close(session))
    assert not sandbox.site_dir.exists()
    assert not sandbox.home.exists()
