"""The async SDK (cloche.AsyncClient, cloche.AsyncSession) against a real gVisor server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

import cloche

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
async def aclient(url: str, token: str) -> AsyncIterator[cloche.AsyncClient]:
    async with cloche.AsyncClient(url, token) as connected:
        yield connected


async def test_state_persists_and_the_session_closes_with_its_block(aclient):
    async with await aclient.create_session() as session:
        await session.run("counter = 1")
        await session.run("counter += 1")
        execution = await session.run("counter")
        assert (execution.status, execution.text, execution.execution_count) == ("ok", "2", 3)
        assert [info.id for info in await aclient.list_sessions()] == [session.id]
    assert await aclient.list_sessions() == []
    with pytest.raises(cloche.SessionNotFound):
        await session.run("counter")


async def test_async_callbacks_get_the_output_in_order_while_the_cell_waits(aclient):
    async with await aclient.create_session() as session:
        seen: list[tuple[str, str]] = []
        started = asyncio.Event()

        async def on_stdout(text: str) -> None:
            seen.append(("stdout", text))
            started.set()

        async def on_stderr(text: str) -> None:
            seen.append(("stderr", text))

        running = asyncio.create_task(
            session.run(
                "import os, sys, time\n"
                "print('one', flush=True)\n"
                "while not os.path.exists('go'):\n"
                "    time.sleep(0.01)\n"
                "print('two', file=sys.stderr, flush=True)\n"
                "print('three', flush=True)",
                on_stdout=on_stdout,
                on_stderr=on_stderr,
            )
        )
        await asyncio.wait_for(started.wait(), 30)
        assert not running.done()  # it waits for the file this upload makes
        await session.upload("go", b"")
        execution = await asyncio.wait_for(running, 30)
        # In order within a stream; across stdout and stderr (two pipes) only where the cell
        # waited between them.
        assert seen[0] == ("stdout", "one\n")
        assert [text for name, text in seen if name == "stdout"] == ["one\n", "three\n"]
        assert [text for name, text in seen if name == "stderr"] == ["two\n"]
        assert execution.logs == cloche.Logs(stdout="one\nthree\n", stderr="two\n")


async def test_a_figure_is_a_display_with_png_bytes(aclient):
    async with await aclient.create_session() as session:
        shown: list[cloche.Result] = []
        execution = await session.run(
            "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
            "plt.bar(['a', 'b'], [3, 5])\nplt.show()",
            on_display=shown.append,
        )
        assert execution.ok, execution.error
        assert len(shown) == 1 and shown[0].png is not None
        assert shown[0].png.startswith(PNG_MAGIC)
        assert execution.results == shown and execution.result is None


async def test_errors_are_data(aclient):
    async with await aclient.create_session() as session:
        execution = await session.run("raise ValueError('bad value')")
        assert execution.status == "error"
        error = execution.error
        assert error is not None and (error.ename, error.evalue) == ("ValueError", "bad value")
        assert "raise ValueError('bad value')" in error.traceback_text
        assert str(error) == "ValueError: bad value"


async def test_files_round_trip(aclient):
    async with await aclient.create_session() as session:
        await session.upload("dir/a b.txt", "spaced name")
        assert await session.download("dir/a b.txt") == b"spaced name"
        execution = await session.run("open('dir/a b.txt').read().upper()")
        assert execution.text == "'SPACED NAME'"
        assert [f.path for f in await session.list_files()] == ["dir/a b.txt"]


async def test_interrupt_from_another_task(aclient):
    async with await aclient.create_session() as session:
        await session.run("before = 'kept'")
        started = asyncio.Event()
        running = asyncio.create_task(
            session.run(
                "import time\nprint('sleeping', flush=True)\ntime.sleep(30)",
                on_stdout=lambda text: started.set(),
            )
        )
        await asyncio.wait_for(started.wait(), 30)
        assert await session.interrupt() is True
        execution = await asyncio.wait_for(running, 30)
        assert execution.status == "interrupted"
        assert (await session.run("before")).text == "'kept'"


async def test_cancelling_a_run_stops_its_cell(aclient):
    async with await aclient.create_session() as session:
        started = asyncio.Event()
        running = asyncio.create_task(
            session.run(
                "import time\nprint('sleeping', flush=True)\ntime.sleep(30)\n"
                "open('finished', 'w').close()",
                on_stdout=lambda text: started.set(),
            )
        )
        await asyncio.wait_for(started.wait(), 30)
        begun = time.monotonic()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        # Cells run one at a time: this one runs once the cancelled one has stopped.
        after = await session.run("import os\nos.path.exists('finished')")
        assert after.text == "False"
        assert time.monotonic() - begun < 25


async def test_one_shot_run(aclient):
    execution = await aclient.run(
        "import json\nprint(json.load(open('cfg.json'))['n'] * 2)", files={"cfg.json": '{"n": 21}'}
    )
    assert execution.logs.stdout == "42\n"
    assert execution.output_files == {}
    assert await aclient.list_sessions() == []
