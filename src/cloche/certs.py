"""Certificates cloche makes for itself: a CA, and certificates it signs, as PEM.

Two users: egress interception (`cloche.network.egress.tls`: a CA the sandboxes trust, and a
certificate per intercepted host) and the cluster's data path (`cloche.cluster.tls`: a CA
per cluster, a certificate per node agent and per front end, checked both ways).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import tempfile

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA = tuple[bytes, bytes]  # a CA's certificate and private key, PEM
Pair = tuple[bytes, bytes]  # a certificate and its private key, PEM

CA_VALID = datetime.timedelta(days=825)
LEAF_VALID = datetime.timedelta(days=30)


def make_ca(common_name: str) -> CA:
    """A new CA (EC P-256), valid CA_VALID from an hour ago."""
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
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
        .not_valid_after(now + CA_VALID)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def issue(ca: CA, names: list[str], *, client: bool = False, server: bool = True) -> Pair:
    """A certificate signed by ca for names (DNS names or IP addresses; the first is its
    common name), for a TLS server, a client, or both."""
    ca_cert = x509.load_pem_x509_certificate(ca[0])
    ca_key = serialization.load_pem_private_key(ca[1], password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    alts: list[x509.GeneralName] = []
    for name in names:
        try:
            alts.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alts.append(x509.DNSName(name))
    purposes = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    purposes += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + LEAF_VALID)
        .add_extension(x509.SubjectAlternativeName(alts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(purposes), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def load_pair(context: ssl.SSLContext, pair: Pair) -> None:
    """Give context a certificate and its key held in memory (ssl reads a chain only from
    files: a private temporary file, gone at once)."""
    with tempfile.NamedTemporaryFile(suffix=".pem") as chain:
        chain.write(pair[0])
        chain.write(pair[1])
        chain.flush()
        context.load_cert_chain(chain.name)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
