"""Mutual TLS on the data path (cluster/tls.py), without Ray or a sandbox: who may talk to
whom, and that nothing crosses in clear."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cloche import certs
from cloche.cluster import tls
from cloche.cluster.link import AgentLink, AgentServer, LinkDown
from cloche.sessions.kernel import EventCallback

SECRET = "s" * 64
CA = tls.make_ca()


async def echo(op: str, args: dict[str, Any], on_event: EventCallback) -> Any:
    if op == "stats":
        return {"seq": 1}
    return {"op": op, **args}


@pytest.fixture
async def agent() -> AsyncIterator[int]:
    """An agent of node-a, with its certificate from the cluster's CA."""
    context = tls.AgentTLS.issue(CA, "node-a", "127.0.0.1").server_context()
    server = AgentServer("node-a", SECRET, echo, tls=context)
    port = await server.start("127.0.0.1", 0)
    yield port
    await server.close()


def link_to(port: int, context: ssl.SSLContext | None, node: str = "node-a") -> AgentLink:
    return AgentLink(node, "127.0.0.1", port, SECRET, lambda *_: None, lambda *_: None, tls=context)


async def test_a_front_end_of_the_cluster_talks_to_its_node_over_tls_1_3(agent) -> None:
    link = link_to(agent, tls.front_end_context(CA))
    await link.connect()
    try:
        assert await link.call("hello", {"n": 1}) == {"op": "hello", "n": 1}
        assert link._writer is not None
        secured = link._writer.get_extra_info("ssl_object")
        assert secured is not None and secured.version() == "TLSv1.3"
        peer = secured.getpeercert()
        names = [value for kind, value in peer["subjectAltName"]]
        assert tls.node_name("node-a") in names
    finally:
        link.close()


async def test_a_link_to_one_node_refuses_another_nodes_certificate(agent) -> None:
    """The agent on that port holds node-a's certificate: a link to node-b won't talk to
    it (a node that came back under a new id can't answer for the old one)."""
    with pytest.raises(LinkDown, match="node-b"):
        await link_to(agent, tls.front_end_context(CA), node="node-b").connect()


async def test_a_client_of_another_ca_is_refused(agent) -> None:
    with pytest.raises(LinkDown):
        await link_to(agent, tls.front_end_context(tls.make_ca())).connect()


async def test_a_client_without_a_certificate_is_refused(agent) -> None:
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cadata=CA[0].decode())
    with pytest.raises(LinkDown):
        link = link_to(agent, bare)
        await link.connect()
        await link.call("hello")  # TLS 1.3 tells the missing certificate after the handshake


async def test_a_client_in_clear_gets_nothing(agent) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", agent)
    writer.write(b"\x00\x00\x00\x10" + b'{"hello": "' + SECRET[:4].encode() + b'"}')
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing said
    writer.close()


async def test_an_agents_certificate_is_not_a_client_certificate() -> None:
    """An agent's own certificate (server only) can't be used to call other agents."""
    agent_pair = tls.AgentTLS.issue(CA, "node-z", "127.0.0.1").pair
    context = tls.AgentTLS.issue(CA, "node-a", "127.0.0.1").server_context()
    server = AgentServer("node-a", SECRET, echo, tls=context)
    port = await server.start("127.0.0.1", 0)
    try:
        thief = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        thief.load_verify_locations(cadata=CA[0].decode())
        certs.load_pair(thief, agent_pair)
        with pytest.raises(LinkDown):
            link = link_to(port, thief)
            await link.connect()
            await link.call("hello")
    finally:
        await server.close()
