"""The MCP server through the `mcp` SDK's own client: `cloche mcp` over stdio, and the
streamable HTTP transport at /mcp, against a real gVisor server with a token."""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, ImageContent, TextContent

from cloche.errors import SessionNotFound
from support import ServerThread, make_config, require_gvisor

CLOCHE = Path(sys.executable).parent / "cloche"
TOKEN = "mcp-token"
TOOLS = {
    "run_python",
    "run_command",
    "create_session",
    "close_session",
    "list_sessions",
    "upload_file",
    "download_file",
    "snapshot_session",
    "fork_session",
    "session_history",
    "list_ports",
    "preview_port",
    "create_volume",
    "list_volumes",
    "delete_volume",
    "list_volume_files",
    "write_volume_file",
    "read_volume_file",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOT = (
    "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
    "plt.plot([1, 3, 2])\nplt.title('from cloche')\n"
)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    require_gvisor()
    state = tmp_path_factory.mktemp("mcp-state")
    with ServerThread(make_config(state, tokens=frozenset({TOKEN}), pool_size=2)) as running:
        yield running


@pytest.fixture
def url(api: ServerThread) -> Iterator[str]:
    yield f"http://127.0.0.1:{api.http_port}"
    assert api.server.manager.list(TOKEN) == [], "a session outlived its MCP connection"


@asynccontextmanager
async def over_stdio(url: str) -> AsyncIterator[Client]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")}
    params = StdioServerParameters(
        command=str(CLOCHE), args=["mcp", "--url", url, "--token", TOKEN], env=env
    )
    async with Client(params) as client:
        yield client


@asynccontextmanager
async def over_http(
    url: str, mode: str = "auto", token: str | None = TOKEN
) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
        transport = streamable_http_client(f"{url}/mcp", http_client=http)
        async with Client(transport, mode=mode) as client:
            yield client


CONNECTIONS = {
    "stdio": lambda url: over_stdio(url),
    "http": lambda url: over_http(url, mode="legacy"),
}


def text_of(result: CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))


async def run(client: Client, code: str, **arguments: Any) -> CallToolResult:
    return await client.call_tool("run_python", {"code": code, **arguments})


@pytest.mark.parametrize("transport", ["stdio", "http", "http-2026"])
async def test_the_tools_are_listed(url, transport):
    connect = over_http(url) if transport == "http-2026" else CONNECTIONS[transport](url)
    async with connect as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(listed) == TOOLS
    schema = listed["run_python"].input_schema
    assert schema["required"] == ["code"]
    assert {"code", "session_id"} <= set(schema["properties"])
    assert "persist" in (listed["run_python"].description or "")


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_state_persists_in_the_connections_own_session(url, api, transport):
    async with CONNECTIONS[transport](url) as client:
        first = await run(client, "import math\nradius = 3\nprint('set')")
        assert not first.is_error, text_of(first)
        assert "set" in text_of(first)
        second = await run(client, "round(math.pi * radius ** 2, 2)")
        assert not second.is_error
        assert second.structured_content is not None
        assert second.structured_content["result"] == "28.27"
        assert second.structured_content["session_id"] == first.structured_content["session_id"]
        assert "28.27" in text_of(second)
        (session,) = api.server.manager.list(TOKEN)
        assert session.id == second.structured_content["session_id"]
    # The connection ended: so did its session (checked by the `url` fixture).


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_matplotlib_plot_comes_back_as_an_image(url, transport):
    async with CONNECTIONS[transport](url) as client:
        result = await run(client, PLOT + "print('drawn')")
        assert not result.is_error, text_of(result)
        images = [block for block in result.content if isinstance(block, ImageContent)]
        assert len(images) == 1
        assert images[0].mime_type == "image/png"
        assert base64.b64decode(images[0].data).startswith(PNG_MAGIC)
        assert "drawn" in text_of(result) and "<Figure" in text_of(result)


async def test_an_exception_is_reported_to_the_model(url):
    async with over_stdio(url) as client:
        await run(client, "kept = 'yes'")
        result = await run(client, "def f():\n    return 1 / 0\nf()")
        assert result.is_error
        assert "ZeroDivisionError: division by zero" in text_of(result)
        assert "return 1 / 0" in text_of(result)
        assert result.structured_content is not None
        assert result.structured_content["error"]["ename"] == "ZeroDivisionError"
        assert text_of(await run(client, "kept")).endswith("'yes'")


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_lone_surrogate_from_the_cell_reaches_the_model_as_an_escape(url, transport):
    # A str UTF-8 can't encode, made by the code; the answer must still be sent.
    async with CONNECTIONS[transport](url) as client:
        result = await run(client, "print('out \\udfff'); raise ValueError('bad \\ud800')")
        assert result.is_error
        assert "ValueError: bad \\ud800" in text_of(result)
        assert result.structured_content is not None
        assert result.structured_content["error"]["evalue"] == "bad \\ud800"
        assert text_of(await run(client, "'fine'")).endswith("'fine'")


async def test_each_connection_gets_its_own_session(url, api):
    async with over_http(url, mode="legacy") as one, over_http(url, mode="legacy") as two:
        await run(one, "who = 'one'")
        await run(two, "who = 'two'")
        assert (await run(one, "who")).structured_content["result"] == "'one'"
        assert (await run(two, "who")).structured_content["result"] == "'two'"
        listed = await one.call_tool("list_sessions", {})
        rows = listed.structured_content["sessions"]
        assert len(rows) == 2
        assert sum(row["this_connection"] for row in rows) == 1
    assert api.server.manager.list(TOKEN) == []


async def test_named_sessions_outlive_calls_and_are_closed_by_name(url, api):
    async with over_stdio(url) as client:
        created = await client.call_tool("create_session", {"profile": "lean"})
        session_id = created.structured_content["session_id"]
        await run(client, "named = 41", session_id=session_id)
        assert (await run(client, "named + 1", session_id=session_id)).structured_content[
            "result"
        ] == "42"
        own = await run(client, "'named' in globals()")  # the connection's own session
        assert own.structured_content["result"] == "False"
        assert own.structured_content["session_id"] != session_id
        closed = await client.call_tool("close_session", {"session_id": session_id})
        assert not closed.is_error
        gone = await run(client, "1", session_id=session_id)
        assert gone.is_error and "not found" in text_of(gone)


async def test_a_session_is_snapshotted_restored_and_forked_by_tools(url, api):
    async with over_stdio(url) as client:
        created = await client.call_tool("create_session", {})
        original = created.structured_content["session_id"]
        await run(client, "state = [1, 2]", session_id=original)
        saved = await client.call_tool("snapshot_session", {"session_id": original})
        assert not saved.is_error, text_of(saved)
        snapshot = saved.structured_content["snapshot_id"]
        restored = await client.call_tool("create_session", {"snapshot": snapshot})
        assert not restored.is_error, text_of(restored)
        copy = restored.structured_content["session_id"]
        forked = await client.call_tool("fork_session", {"session_id": original, "count": 2})
        assert not forked.is_error, text_of(forked)
        copies = forked.structured_content["session_ids"]
        assert len({original, copy, *copies}) == 4
        for number, sid in enumerate([copy, *copies]):
            answer = await run(client, f"state.append({number}); state", session_id=sid)
            assert answer.structured_content["result"] == f"[1, 2, {number}]"
        assert (await run(client, "state", session_id=original)).structured_content[
            "result"
        ] == "[1, 2]"
        for sid in (original, copy, *copies):
            await client.call_tool("close_session", {"session_id": sid})
        api.call(api.server.manager.delete_snapshot(snapshot, TOKEN))


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_command_runs_beside_the_cells_and_tells_how_it_ended(url, api, transport):
    async with CONNECTIONS[transport](url) as client:
        wrote = await run(client, "open('from-cell.txt', 'w').write('written by a cell')")
        assert not wrote.is_error, text_of(wrote)
        read = await client.call_tool("run_command", {"cmd": "cat from-cell.txt; echo; id -un"})
        assert not read.is_error, text_of(read)
        done = read.structured_content
        assert (done["exit_code"], done["status"], done["end_reason"]) == (0, "exited", "ok")
        assert done["stdout"] == "written by a cell\nuser\n" and done["stderr"] == ""
        assert done["session_id"] == wrote.structured_content["session_id"]  # the same one
        assert "exit code 0" in text_of(read) and "written by a cell" in text_of(read)
        failed = await client.call_tool(
            "run_command", {"cmd": "sh", "args": ["-c", "echo oops >&2; exit 3"]}
        )
        assert failed.is_error  # the model is told it did not succeed, with its output
        assert (failed.structured_content["exit_code"], failed.structured_content["stderr"]) == (
            3,
            "oops\n",
        )
        assert "exit code 3" in text_of(failed) and "oops" in text_of(failed)
        rooted = await client.call_tool(
            "run_command", {"cmd": "id -u; pwd", "user": "root", "cwd": "/tmp"}
        )
        assert rooted.structured_content["stdout"] == "0\n/tmp\n"
        slow = await client.call_tool("run_command", {"cmd": "sleep 30", "timeout": 1})
        assert slow.is_error and slow.structured_content["status"] == "timeout"
        created = await client.call_tool("create_session", {})
        named = created.structured_content["session_id"]
        there = await client.call_tool(
            "run_command", {"cmd": "ls from-cell.txt", "session_id": named}
        )
        assert there.structured_content["exit_code"] != 0  # another session's files
        await client.call_tool("close_session", {"session_id": named})
        missing = await client.call_tool("run_command", {"cmd": "true", "session_id": "nope"})
        assert missing.is_error and "not found" in text_of(missing)


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_session_is_made_of_the_template_asked(url, transport):
    async with CONNECTIONS[transport](url) as client:
        made = await client.call_tool("create_session", {"template": "python"})
        assert not made.is_error, text_of(made)
        assert made.structured_content["template"] == "python"
        assert "template python" in text_of(made)
        await client.call_tool(
            "close_session", {"session_id": made.structured_content["session_id"]}
        )
        refused = await client.call_tool("create_session", {"template": "no-such"})
        assert refused.is_error and "TemplateNotFound" in text_of(refused)


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_sessions_are_made_with_metadata_and_listed_by_it(url, transport):
    async with CONNECTIONS[transport](url) as client:
        made = await client.call_tool(
            "create_session", {"metadata": {"agent": "planner", "run": "42"}}
        )
        assert not made.is_error, text_of(made)
        assert made.structured_content["metadata"] == {"agent": "planner", "run": "42"}
        planner = made.structured_content["session_id"]
        other = await client.call_tool("create_session", {"metadata": {"run": "43"}})
        coder = other.structured_content["session_id"]

        async def listed(**filters: Any) -> dict[str, Any]:
            answer = await client.call_tool("list_sessions", filters)
            assert not answer.is_error, text_of(answer)
            return {row["session_id"]: row for row in answer.structured_content["sessions"]}

        found = await client.call_tool("list_sessions", {"metadata": {"run": "42"}})
        assert [row["session_id"] for row in found.structured_content["sessions"]] == [planner]
        assert found.structured_content["sessions"][0]["metadata"] == {
            "agent": "planner",
            "run": "42",
        }
        assert text_of(found).startswith(f"{planner}  lean  idle     cells=0 agent=planner run=42")
        assert set(await listed()) == {planner, coder}
        assert set(await listed(state="idle", profile="lean", metadata={"run": "43"})) == {coder}
        assert await listed(state="paused") == {}
        refused = await client.call_tool("create_session", {"metadata": {"": "empty key"}})
        assert refused.is_error and "InvalidMetadata" in text_of(refused)
        for session_id in (planner, coder):
            await client.call_tool("close_session", {"session_id": session_id})


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_sessions_history_is_read_back_with_its_outputs(url, transport):
    async with CONNECTIONS[transport](url) as client:
        created = await client.call_tool("create_session", {})
        session_id = created.structured_content["session_id"]
        await run(client, "print('hello')\n6 * 7", session_id=session_id)
        await run(client, "1 / 0", session_id=session_id)
        for number in range(3):
            await run(client, f"x{number} = {number}", session_id=session_id)

        async def history(**arguments: Any) -> CallToolResult:
            answer = await client.call_tool("session_history", arguments)
            assert not answer.is_error, text_of(answer)
            return answer

        last = await history(session_id=session_id, limit=2)  # without after: the last ones
        assert [c["code"] for c in last.structured_content["cells"]] == ["x1 = 1", "x2 = 2"]
        first = await history(session_id=session_id, after=0, limit=2)
        hello, error = first.structured_content["cells"]
        assert (hello["number"], hello["stdout"], hello["result"]) == (1, "hello\n", "42")
        # (`cloche mcp` sends its cells through the HTTP API; /mcp straight to the manager)
        front_end = "http" if transport == "stdio" else "mcp"
        assert (hello["end_reason"], hello["front_end"]) == ("ok", front_end)
        assert (error["end_reason"], error["error"]["ename"]) == ("error", "ZeroDivisionError")
        text = text_of(first)
        assert text.startswith("[cell 1, ok, ") and "code:\nprint('hello')\n6 * 7\n" in text
        assert "[cell 2, error, " in text and "ZeroDivisionError: division by zero" in text
        assert "x0 = 0" not in text
        # this connection's own session, when none is named
        await run(client, "mine = 1")
        own = await history()
        assert [c["code"] for c in own.structured_content["cells"]] == ["mine = 1"]
        missing = await client.call_tool("session_history", {"session_id": "nope"})
        assert missing.is_error and "not found" in text_of(missing)
        await client.call_tool("close_session", {"session_id": session_id})


async def test_files_go_up_and_come_down(url):
    async with over_stdio(url) as client:
        up = await client.call_tool("upload_file", {"path": "in/data.csv", "content": "a,b\n1,2\n"})
        assert not up.is_error, text_of(up)
        binary = bytes(range(256))
        await client.call_tool(
            "upload_file",
            {"path": "blob.bin", "content": base64.b64encode(binary).decode(), "is_base64": True},
        )
        result = await run(
            client,
            PLOT
            + "plt.savefig('plot.png')\n"
            + "(open('in/data.csv').read().count(','), len(open('blob.bin', 'rb').read()))",
        )
        assert result.structured_content["result"] == "(2, 256)"
        text = await client.call_tool("download_file", {"path": "in/data.csv"})
        assert text_of(text) == "a,b\n1,2\n"
        raw = await client.call_tool("download_file", {"path": "blob.bin"})
        assert base64.b64encode(binary).decode() in text_of(raw)
        picture = await client.call_tool("download_file", {"path": "plot.png"})
        (image,) = [block for block in picture.content if isinstance(block, ImageContent)]
        assert base64.b64decode(image.data).startswith(PNG_MAGIC)
        missing = await client.call_tool("download_file", {"path": "nothing.txt"})
        assert missing.is_error and "nothing.txt" in text_of(missing)


async def test_the_2026_protocol_has_no_connections_so_state_needs_a_named_session(url, api):
    async with over_http(url) as client:
        assert client.protocol_version == "2026-07-28"
        oneoff = await run(client, "x = 1")
        assert "one-off session" in text_of(oneoff) and "create_session" in text_of(oneoff)
        assert api.server.manager.list(TOKEN) == []  # it was closed at once
        created = await client.call_tool("create_session", {})
        session_id = created.structured_content["session_id"]
        await run(client, "x = 1", session_id=session_id)
        assert (await run(client, "x + 1", session_id=session_id)).structured_content[
            "result"
        ] == "2"
        await client.call_tool("close_session", {"session_id": session_id})


def test_mcp_over_http_needs_the_token(url):
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "test", "version": "0"},
        },
    }
    headers = {"Accept": "application/json, text/event-stream"}
    with httpx.Client(base_url=url, timeout=30) as http:
        refused = http.post("/mcp", json=initialize, headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "unauthorized"
        wrong = http.post(
            "/mcp", json=initialize, headers={**headers, "Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        accepted = http.post(
            "/mcp", json=initialize, headers={**headers, "Authorization": f"Bearer {TOKEN}"}
        )
        assert accepted.status_code == 200, accepted.text
        session = accepted.headers["mcp-session-id"]
        ended = http.delete(
            "/mcp",
            headers={"Authorization": f"Bearer {TOKEN}", "mcp-session-id": session},
        )
        assert ended.status_code < 300, ended.text


async def test_sessions_made_over_mcp_belong_to_the_token(url, api):
    async with over_http(url, mode="legacy") as client:
        result = await run(client, "1 + 1")
        session_id = result.structured_content["session_id"]
        assert [s.id for s in api.server.manager.list(TOKEN)] == [session_id]
        with pytest.raises(SessionNotFound):
            api.server.manager.get(session_id, "another-token")


async def test_a_connected_client_does_not_hold_up_the_servers_shutdown(make_server):
    server = make_server(pool_size=1)
    async with over_http(f"http://127.0.0.1:{server.http_port}", mode="legacy") as client:
        assert not (await run(client, "1 + 1")).is_error
        begun = time.monotonic()
        await asyncio.to_thread(server.stop)  # its MCP streams are still open
        assert time.monotonic() - begun < 30
        assert server.server.manager.list(None) == []


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_volumes_are_made_filled_mounted_and_deleted_by_tools(url, transport):
    name = f"mcp-{transport}"
    async with CONNECTIONS[transport](url) as client:
        made = await client.call_tool("create_volume", {"name": name, "size_mib": 4})
        assert not made.is_error, text_of(made)
        wrote = await client.call_tool(
            "write_volume_file", {"name": name, "path": "in/note.txt", "content": "kept"}
        )
        assert not wrote.is_error, text_of(wrote)
        created = await client.call_tool("create_session", {"volumes": [name]})
        assert not created.is_error, text_of(created)
        session_id = created.structured_content["session_id"]
        assert created.structured_content["volumes"] == [
            {"name": name, "path": f"/mnt/{name}", "read_only": False}
        ]
        code = f"open('/mnt/{name}/in/note.txt').read() + '!'"
        read = await run(client, code, session_id=session_id)
        assert read.structured_content["result"] == "'kept!'"
        await run(client, f"open('/mnt/{name}/out.txt', 'w').write('made')", session_id=session_id)
        listed = await client.call_tool("list_volumes", {})
        (row,) = [v for v in listed.structured_content["volumes"] if v["name"] == name]
        assert row["sessions"] == [session_id]
        busy = await client.call_tool("delete_volume", {"name": name})
        assert busy.is_error and "VolumeInUse" in text_of(busy)
        await client.call_tool("close_session", {"session_id": session_id})
        files = await client.call_tool("list_volume_files", {"name": name})
        paths = [f["path"] for f in files.structured_content["files"]]
        assert paths == ["in/note.txt", "out.txt"]
        out = await client.call_tool("read_volume_file", {"name": name, "path": "out.txt"})
        assert text_of(out) == "made"
        escape = await client.call_tool("read_volume_file", {"name": name, "path": "../x"})
        assert escape.is_error and "PathRefused" in text_of(escape)
        gone = await client.call_tool("delete_volume", {"name": name})
        assert not gone.is_error, text_of(gone)
        missing = await client.call_tool("list_volume_files", {"name": name})
        assert missing.is_error and f"Volume {name} not found" in text_of(missing)
