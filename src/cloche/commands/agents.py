"""Commands for agents: `cloche tool-schema` (OpenAI function calling) and `cloche mcp`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from cloche.client.tool import tool_schema
from cloche.commands.common import add_connection_options, reports_errors


def add(subparsers: Any) -> None:
    schema = subparsers.add_parser(
        "tool-schema",
        help="print an OpenAI function-calling definition of the run_python tool",
        description="Print the JSON definition of a run_python tool for OpenAI-style function "
        "calling (tools=[...]); run the calls it asks for with a cloche Session.",
    )
    schema.add_argument(
        "--style",
        choices=("chat", "responses"),
        default="chat",
        help="chat: Chat Completions' shape; responses: the Responses API's",
    )
    add_connection_options(schema)  # accepted for symmetry; the schema needs no server
    schema.set_defaults(handler=_tool_schema)

    mcp = subparsers.add_parser(
        "mcp",
        help="serve cloche's tools to an MCP host over stdio",
        description="An MCP server on stdin/stdout (for Claude Desktop, Cursor, ...) whose "
        "tools run code on the cloche server at --url: run_python, create_session, "
        "close_session, list_sessions, upload_file, download_file. The host's connection gets "
        "a session of its own, closed when the host goes away.",
    )
    add_connection_options(mcp)
    mcp.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="warning"
    )
    mcp.set_defaults(handler=_mcp)


def _tool_schema(args: argparse.Namespace) -> int:
    print(json.dumps(tool_schema(args.style), indent=2))
    return 0


@reports_errors("mcp")
def _mcp(args: argparse.Namespace) -> int:
    # Configured before the MCP SDK is imported: it would install its own handlers otherwise.
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    from cloche.client.aio import AsyncClient
    from cloche.server.mcp.stdio import serve_stdio

    async def serve() -> None:
        async with AsyncClient(args.url, args.token, timeout_s=args.request_timeout) as client:
            await serve_stdio(client)

    asyncio.run(serve())
    return 0
