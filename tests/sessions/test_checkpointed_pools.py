"""The data pool refills by restoring a checkpoint of one started sandbox (its image),
against real gVisor: clones are separate sessions that draw their own random numbers, and a
template that can't be restored sends the pool back to starting sandboxes afresh."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cloche.sessions.pool import WarmPool
from support import ServerThread, make_config, require_gvisor


@contextmanager
def data_server(state_root: Path, **config: object) -> Iterator[tuple[ServerThread, WarmPool]]:
    """A server with only a data pool, and that pool once it is full."""
    require_gvisor()
    with ServerThread(make_config(state_root, pool_size=0, **config)) as server:
        pool = server.server.manager.pools["data"]
        server.call(pool.wait_full(), timeout_s=300)
        yield server, pool


def run(server: ServerThread, session_id: str, code: str) -> str | None:
    result = server.call(server.server.manager.execute(session_id, code))
    assert result.status.value == "ok", result.error or result.message
    return result.result_text


def test_data_sessions_are_restored_clones_that_are_their_own(state_root):
    with data_server(state_root, data_pool_size=2) as (server, pool):
        manager = server.server.manager
        assert pool._image is not None, "no template was made"
        kernels = list(pool._ready)
        assert all(k.sandbox.restore_from == pool._image for k in kernels)
        assert all(k.sandbox.sandbox_pid for k in kernels), "interrupts need the pid"

        a = server.call(manager.create(profile="data")).id
        b = server.call(manager.create(profile="data")).id
        draws = "import random, numpy; (random.random(), float(numpy.random.rand()))"
        assert run(server, a, draws) != run(server, b, draws)
        assert run(server, a, "import pandas; open('mine.txt', 'w').write('a')") == "1"
        assert run(server, b, "import os; os.listdir('.')") == "[]"
        assert server.call(manager.files(a, None)).read("mine.txt") == b"a"  # type: ignore[attr-defined]
        assert run(server, a, "x = 41\nx + 1") == "42"
        # The template itself was stopped by its checkpoint: only the clones run (once
        # the start-up probe of ptrace, a sandbox of its own, has ended).
        backend = server.server.backend
        if backend._ptrace_probe is not None:
            backend._ptrace_probe.join(120)
        assert set(backend.runsc.list_ids()) == {k.id for k in kernels}
        server.call(manager.close(a))
        server.call(manager.close(b))


def test_a_template_that_cannot_be_restored_sends_the_pool_back_to_fresh_starts(state_root):
    with data_server(state_root, data_pool_size=1) as (server, pool):
        manager = server.server.manager
        image = pool._image
        assert image is not None
        shutil.rmtree(image)
        image.mkdir()  # an image directory with nothing in it

        info = server.call(manager.create(profile="data"))  # the refill restores, and fails
        server.call(pool.wait_full(), timeout_s=300)
        assert pool._image is None and pool._no_image
        assert pool._ready[0].sandbox.restore_from is None
        assert run(server, info.id, "import sys; 'pandas' in sys.modules") == "True"
        other = server.call(manager.create(profile="data"))
        assert run(server, other.id, "import sys; 'pandas' in sys.modules") == "True"


def test_without_the_template_data_sandboxes_start_afresh(state_root):
    with data_server(state_root, data_pool_size=1, data_template=False) as (server, pool):
        assert pool._image is None
        assert pool._ready[0].sandbox.restore_from is None
        assert not (server.server.backend.state.path / "templates").exists()
        info = server.call(server.server.manager.create(profile="data"))
        assert run(server, info.id, "import sys; 'pandas' in sys.modules") == "True"
