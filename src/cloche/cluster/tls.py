"""Mutual TLS on the data path between front ends and node agents.

The cluster's directory makes one CA when the cluster starts (it keeps it where it keeps the
cluster's secret: in its own memory, handed over Ray's token-authenticated channel). A front
end holds the CA, issues itself a client certificate, and issues each agent it starts a
server certificate naming that node (`node_name`) and its address; an agent gets only its own
certificate and the CA's, never the CA's key. Both ends speak TLS 1.3 only and check the
other: an agent takes only clients with a certificate of the CA, and a front end's link to a
node accepts only the certificate of that very node id (a node declared dead and back under a
new id can't answer for the old one). The cluster's secret stays as a second factor inside
the tunnel: a leaked certificate alone opens nothing.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from cloche import certs
from cloche.certs import CA, Pair

FRONT_END_NAME = "front-end.cloche"


def node_name(node_id: str) -> str:
    """The name a node agent's certificate carries, and that its links check."""
    return f"{node_id}.node.cloche"


def make_ca() -> CA:
    return certs.make_ca("cloche cluster data path CA")


@dataclass(frozen=True)
class AgentTLS:
    """What an agent is given: its certificate and key, and the CA's certificate."""

    ca_pem: bytes
    pair: Pair

    @classmethod
    def issue(cls, ca: CA, node_id: str, address: str) -> AgentTLS:
        return cls(ca[0], certs.issue(ca, [node_name(node_id), address], server=True))

    def server_context(self) -> ssl.SSLContext:
        """For the agent's listening socket: TLS 1.3, a client certificate of the CA
        required."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.ca_pem.decode())
        certs.load_pair(context, self.pair)
        return context


def front_end_context(ca: CA) -> ssl.SSLContext:
    """For a front end's links: TLS 1.3, its own client certificate, the agents' checked
    against the CA and the node's name (`server_hostname=node_name(node_id)`)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=ca[0].decode())
    certs.load_pair(context, certs.issue(ca, [FRONT_END_NAME], client=True, server=False))
    return context
