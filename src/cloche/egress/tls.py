"""TLS for intercepted hosts: a CA made per server, and its certificates for those hosts.

Only hosts that carry a secret are intercepted (the proxy must see the request to put the
secret in); every other https connection is a tunnel, TLS end to end. The sandboxes trust the
CA through their CA bundle; its key lives in the server's memory only (a cluster's front end
hands it to its agents, as it hands them the cluster's secret). Upstreams are verified
against the system's CAs and the policy file's upstream_ca_file, as any client would.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

_VALID = datetime.timedelta(days=825)

CA = tuple[bytes, bytes]  # a CA's certificate and private key, PEM


def make_ca() -> CA:
    """A new interception CA. One per server; a cluster's front end makes one for all of
    its nodes, so that a session that moves keeps trusting its intercepted hosts."""
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cloche egress interception CA")])
    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + _VALID)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


class Interceptor:
    """The server's CA, the server-side contexts made with it, and the client-side context
    that verifies upstreams."""

    def __init__(self, upstream_ca_file: Path | None = None, ca: CA | None = None) -> None:
        cert_pem, key_pem = ca or make_ca()
        self.ca = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self._key = key
        self._name = self.ca.subject
        self.ca_pem = cert_pem
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
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # ssl loads a chain from files only: a private temporary file, gone at once.
        with tempfile.NamedTemporaryFile(suffix=".pem") as chain:
            chain.write(cert.public_bytes(serialization.Encoding.PEM))
            chain.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
            chain.flush()
            context.load_cert_chain(chain.name)
        return context
