"""Ports through every client: the SDK (blocking and async), `cloche ports`, and the MCP
tools over stdio (`cloche mcp`) and over /mcp, against a real gVisor server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client as MCPClient
from mcp import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

import cloche
from port_apps import ECHO, start_app
from support import ServerThread, make_config, require_gvisor

pytestmark = [pytest.mark.gvisor, pytest.mark.timeout(600)]
TOKEN = "ports-client-token"
CLOCHE = Path(sys.executable).parent / "cloche"


@pytest.fixture(scope="module")
def served(state_root) -> Iterator[dict[str, Any]]:
    """A server without a preview domain; a session of TOKEN's with the echo app on 8000."""
    require_gvisor()
    with ServerThread(make_config(state_root, tokens=frozenset({TOKEN}))) as server:
        url = f"http://127.0.0.1:{server.http_port}"
        with httpx.Client(base_url=url, timeout=120, headers=_bearer()) as http:
            session_id = http.post("/v1/sessions").json()["id"]
            start_app(http, session_id, ECHO, 8000, "127.0.0.1", "A")
            yield {"server": server, "url": url, "session_id": session_id}


def _bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def _opens(url: str, name: str = "A") -> None:
    """The URL answers, without a token, with the app's page."""
    opened = httpx.get(url, timeout=120)
    assert opened.status_code == 200, opened.text
    assert opened.headers["x-app-name"] == name


def test_the_blocking_sdk_lists_ports_and_makes_a_preview_url(served):
    with cloche.Client(served["url"], TOKEN) as client:
        session = client.session(served["session_id"])
        assert 8000 in session.ports.list()
        preview = session.ports.url(8000, ttl_s=120)
        assert isinstance(preview, cloche.PreviewURL)
        assert preview.url.startswith(f"{served['url']}/v1/sessions/{session.id}/ports/8000/?")
        assert 100 < preview.expires_at.timestamp() - time.time() <= 120
        _opens(preview.url)
        with pytest.raises(cloche.InvalidRequest):
            session.ports.url(8000, ttl_s=0)


async def test_the_async_sdk_lists_ports_and_makes_a_preview_url(served):
    async with cloche.AsyncClient(served["url"], TOKEN) as client:
        session = await client.session(served["session_id"])
        assert 8000 in await session.ports.list()
        preview = await session.ports.url(8000)
        assert str(preview) == preview.url
    async with httpx.AsyncClient(timeout=120) as browser:
        response = await browser.get(preview.url)
    assert response.headers["x-app-name"] == "A"


def test_the_sdk_says_so_when_nothing_listens(served):
    with (
        cloche.Client(served["url"], TOKEN) as client,
        httpx.Client(base_url=served["url"], timeout=120, headers=_bearer()) as http,
    ):
        session = client.session(served["session_id"])
        refused = http.get(session.ports.path(8999))
        assert refused.status_code == 502
        with pytest.raises(cloche.SessionNotFound):
            client.session("00000000-0000-4000-8000-000000000000").ports.list()


def test_cloche_ports_lists_and_prints_a_preview_url(served):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")}
    base = [str(CLOCHE), "ports", served["session_id"], "--url", served["url"], "--token", TOKEN]
    listed = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "8000" in listed.stdout.split()
    as_json = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=120)
    assert {"port": 8000} in json.loads(as_json.stdout)["ports"]
    made = subprocess.run(
        [*base, "--preview", "8000", "--ttl", "60"], capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stderr
    _opens(made.stdout.strip())
    refused = subprocess.run(
        [*base, "--preview", "70000"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2
    assert refused.stderr.startswith("cloche ports: ")


@asynccontextmanager
async def _over_stdio(url: str) -> AsyncIterator[MCPClient]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCHE_")}
    params = StdioServerParameters(
        command=str(CLOCHE), args=["mcp", "--url", url, "--token", TOKEN], env=env
    )
    async with MCPClient(params) as client:
        yield client


@asynccontextmanager
async def _over_http(url: str) -> AsyncIterator[MCPClient]:
    async with httpx2.AsyncClient(headers=_bearer(), timeout=120) as http:
        transport = streamable_http_client(f"{url}/mcp", http_client=http)
        async with MCPClient(transport, mode="legacy") as client:
            yield client


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_the_mcp_tools_list_ports_and_make_a_preview_url(served, transport):
    connect = _over_stdio if transport == "stdio" else _over_http
    async with connect(served["url"]) as client:
        session_id = served["session_id"]
        listed = await client.call_tool("list_ports", {"session_id": session_id})
        assert not listed.is_error, listed
        assert 8000 in listed.structured_content["ports"]
        made = await client.call_tool(
            "preview_port", {"session_id": session_id, "port": 8000, "ttl_s": 60}
        )
        assert not made.is_error, made
        url = made.structured_content["url"]
        refused = await client.call_tool("preview_port", {"session_id": session_id, "port": 0})
        assert refused.is_error
    async with httpx.AsyncClient(timeout=120) as browser:
        opened = await browser.get(url)
    assert opened.headers["x-app-name"] == "A"
