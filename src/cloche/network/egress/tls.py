"""TLS for intercepted hosts: a CA made per server, and its certificates for those hosts.

Only hosts that carry a secret are intercepted (the proxy must see the request to put the
secret in); every other https connection is a tunnel, TLS end to end. The sandboxes trust the
CA through their CA bundle; its key lives in the server's memory only (a cluster's front end
hands it to its agents, as it hands them the cluster's secret). Upstreams are verified
against the system's CAs and the policy file's upstream_ca_file, as any client would.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from cryptography import x509

from cloche import certs
from cloche.certs import CA


def make_ca() -> CA:
    """A new interception CA. One per server; a cluster's front end makes one for all of
    its nodes, so that a session that moves keeps trusting its intercepted hosts."""
    return certs.make_ca("cloche egress interception CA")


class Interceptor:
    """The server's CA, the server-side contexts made with it, and the client-side context
    that verifies upstreams."""

    def __init__(self, upstream_ca_file: Path | None = None, ca: CA | None = None) -> None:
        self._ca_pair = ca or make_ca()
        self.ca = x509.load_pem_x509_certificate(self._ca_pair[0])
        self.ca_pem = self._ca_pair[0]
        self._contexts: dict[str, ssl.SSLContext] = {}
        self.upstream = ssl.create_default_context()
        if upstream_ca_file is not None:
            self.upstream.load_verify_locations(cafile=str(upstream_ca_file))

    def server_context(self, host: str) -> ssl.SSLContext:
        """A context that presents a certificate for host, signed by the CA."""
        context = self._contexts.get(host)
        if context is None:
            context = self._contexts[host] = self._make(host)
        return context

    def _make(self, host: str) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        certs.load_pair(context, certs.issue(self._ca_pair, [host]))
        return context
