"""The async E2B SDK (`AsyncSandbox`) over the same paths as the blocking one, against real
gVisor: code, files (watch by stream), commands, terminals, contexts, lifecycle, tenants."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    NotFoundException,
    PtySize,
    SandboxException,
    SandboxQuery,
)
from e2b_code_interpreter import AsyncSandbox

from support import E2B_OTHER as OTHER

pytestmark = [pytest.mark.gvisor]
FIVE_MIB = bytes(range(256)) * (5 * 4096)


async def until(check, timeout_s: float = 60.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout_s} s")
        await asyncio.sleep(0.1)


@pytest.fixture
async def sbx(e2b_env: dict[str, str]) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(timeout=600)
    yield sandbox
    try:
        await sandbox.kill()
    except SandboxException:
        pass


async def test_run_code_state_streams_png_errors(sbx: AsyncSandbox) -> None:
    await sbx.run_code("x = 41")
    said: list[str] = []

    async def on_stdout(message) -> None:  # async callbacks are awaited
        said.append(message.line)

    execution = await sbx.run_code("print('one')\nx + 1", on_stdout=on_stdout)
    assert execution.text == "42" and said == ["one\n"]
    png = (
        "import base64\n"
        "class Dot:\n"
        "    def _repr_png_(self):\n"
        "        return base64.b64decode('iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
        "2mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==')\n"
        "Dot()"
    )
    figure = await sbx.run_code(png)  # a PNG as the cell's value (matplotlib: test_sdk.py)
    assert figure.results[0].png.startswith("iVBORw0KGgo") and figure.results[0].is_main_result
    failed = await sbx.run_code("raise ValueError('nope')")
    assert failed.error is not None and failed.error.name == "ValueError"
    assert failed.error.value == "nope"


async def test_files(sbx: AsyncSandbox) -> None:
    await sbx.files.write("/home/user/d/a.txt", "hello")
    assert await sbx.files.read("/home/user/d/a.txt") == "hello"
    assert await sbx.files.make_dir("/home/user/d/sub") is True
    assert await sbx.files.make_dir("/home/user/d/sub") is False
    assert sorted(e.name for e in await sbx.files.list("/home/user/d")) == ["a.txt", "sub"]
    await sbx.files.rename("/home/user/d/a.txt", "/home/user/d/sub/b.txt")
    assert await sbx.files.exists("/home/user/d/sub/b.txt")
    await sbx.files.remove("/home/user/d")
    with pytest.raises(FileNotFoundException):
        await sbx.files.read("/home/user/d/sub/b.txt")
    await sbx.files.write("/home/user/big.bin", FIVE_MIB, gzip=True)
    assert bytes(await sbx.files.read("/home/user/big.bin", format="bytes")) == FIVE_MIB


async def test_watch_dir_streams_events(sbx: AsyncSandbox) -> None:
    await sbx.files.make_dir("/home/user/w")
    events = []
    handle = await sbx.files.watch_dir("/home/user/w", on_event=events.append, timeout=120)
    await sbx.files.write("/home/user/w/new.txt", "x")
    await until(lambda: any(e.name == "new.txt" for e in events), 30, "a create event")
    assert events[0].type.value == "create"
    await handle.stop()


async def test_commands(sbx: AsyncSandbox) -> None:
    result = await sbx.commands.run("echo out; echo err >&2")
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as raised:
        await sbx.commands.run("exit 5")
    assert raised.value.exit_code == 5
    seen: list[str] = []
    await sbx.commands.run("echo a; echo b", on_stdout=seen.append)
    assert "".join(seen) == "a\nb\n"
    sleeper = await sbx.commands.run("sleep 300", background=True)
    assert sleeper.pid in [p.pid for p in await sbx.commands.list()]
    assert await sbx.commands.kill(sleeper.pid) is True
    cat = await sbx.commands.run("cat", background=True, stdin=True)
    await sbx.commands.send_stdin(cat.pid, "typed\n")
    await sbx.commands.close_stdin(cat.pid)
    assert (await cat.wait()).stdout == "typed\n"


async def test_pty(sbx: AsyncSandbox) -> None:
    output = bytearray()
    terminal = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=output.extend, timeout=120)
    await sbx.pty.send_stdin(terminal.pid, b"echo $((6*7))\n")
    await until(lambda: b"42" in output, 60, "the terminal's answer")
    await sbx.pty.resize(terminal.pid, PtySize(rows=40, cols=120))
    await sbx.pty.send_stdin(terminal.pid, b"stty size\n")
    await until(lambda: b"40 120" in output, 60, "the resized terminal")
    assert await sbx.pty.kill(terminal.pid) is True


async def test_lifecycle_connect_pause_list_timeout_kill(sbx: AsyncSandbox) -> None:
    await sbx.run_code("kept = 7")
    assert await sbx.pause() is True
    back = await AsyncSandbox.connect(sbx.sandbox_id)
    assert (await back.run_code("kept * 6")).text == "42"
    info = await back.get_info()
    assert info.state.value == "running"
    listed = await AsyncSandbox.list(query=SandboxQuery(metadata={})).next_items()
    assert sbx.sandbox_id in [s.sandbox_id for s in listed]
    await back.set_timeout(2)
    await until(_stopped(back), 60, "the end at its timeout")
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(sbx.sandbox_id)


def _stopped(sandbox: AsyncSandbox):
    async def check() -> bool:
        return not await sandbox.is_running()

    return check


async def test_contexts(sbx: AsyncSandbox) -> None:
    context = await sbx.create_code_context(language="python")
    assert (await sbx.run_code("3 * 3", context=context)).text == "9"
    shell = await sbx.create_code_context(language="bash")
    ran = await sbx.run_code("echo $((2+3))", context=shell)
    assert "".join(ran.logs.stdout) == "5\n"
    with pytest.raises(SandboxException) as raised:
        await sbx.run_code("1", language="java")
    assert "python, bash" in str(raised.value)


async def test_keys_and_tenants(sbx: AsyncSandbox) -> None:
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(api_key="not-a-token")
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(sbx.sandbox_id, api_key=OTHER)
