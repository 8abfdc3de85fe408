"""Egress for a server: its policies, the doors of its sessions, and where records go.

Handed to the session manager by the server (as metrics are): the manager asks it for a
session's policy when the session is made, and for a door when the session's sandbox runs.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import ssl
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cloche.certs import CA
from cloche.errors import EgressConfigError
from cloche.network.egress.policy import EgressConfig, Policy
from cloche.network.egress.proxy import Door, Record
from cloche.network.egress.secrets import Secrets, Substitution
from cloche.network.egress.tls import Interceptor

log = logging.getLogger("cloche.egress")

AUDIT_MAX_BYTES = 64 * 1024 * 1024  # an audit file is rotated at this size
AUDIT_BACKUPS = 4
DOOR_SOCKET = "door.sock"  # in a sandbox's door directory (`/run/cloche` inside)
CA_BUNDLE = "ca.pem"


class Egress:
    """Args:
    config: the server's ceiling (--egress-policy).
    audit_path: where records go, one JSON object per line (rotated by size).
    report: also told of every record (the server's metrics).
    secrets: the server's secrets (--secrets), for the policies that name them.
    ca: the interception CA to use (a cluster's, shared by its nodes); a new one without.

    Raises:
        EgressConfigError: a policy names a secret there is none of, or one whose hosts it
            does not allow.
    """

    def __init__(
        self,
        config: EgressConfig,
        audit_path: Path,
        report: Callable[[Record], None] | None = None,
        secrets: Secrets | None = None,
        ca: CA | None = None,
    ) -> None:
        self.config = config
        self.secrets = secrets or Secrets({})
        self.secrets.check(config.policies.values())
        self._report = report
        audit_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        handler = logging.handlers.RotatingFileHandler(
            audit_path, maxBytes=AUDIT_MAX_BYTES, backupCount=AUDIT_BACKUPS, encoding="utf-8"
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._audit = logging.Logger("cloche.network.egress.audit")  # not the root's: its own file
        self._audit.addHandler(handler)
        self._audit.propagate = False
        self.audit_path = audit_path
        self.interceptor = (
            Interceptor(config.upstream_ca_file, ca) if self.secrets.by_name else None
        )
        self.ca_bundle = _ca_bundle(config.upstream_ca_file)
        if self.interceptor is not None:
            self.ca_bundle += b"\n" + self.interceptor.ca_pem

    @classmethod
    def load(
        cls,
        policy_file: Path,
        audit_path: Path,
        report: Callable[[Record], None] | None = None,
        secrets_file: Path | None = None,
        ca: CA | None = None,
    ) -> Egress:
        """Raises EgressConfigError: a file that can't be read or used."""
        secrets = Secrets.load(secrets_file) if secrets_file is not None else None
        try:
            return cls(EgressConfig.load(policy_file), audit_path, report, secrets, ca)
        except EgressConfigError as exc:
            if secrets_file is None and "does not hold" in str(exc):
                raise EgressConfigError(f"{exc} (no --secrets file was given)") from exc
            raise

    def placeholders(self, policy: Policy, kept: Mapping[str, str] | None) -> dict[str, str]:
        """A session's placeholders for its policy's secrets (those it had are kept)."""
        return self.secrets.placeholders(policy, kept)

    def policy_for(self, asked: str | Mapping[str, Any] | None) -> Policy | None:
        """What a session gets for what it asked (None: no egress). Raises EgressRefused."""
        return self.config.resolve(asked)

    async def open_door(
        self,
        session_id: str,
        owner: str | None,
        policy: Policy,
        directory: Path,
        placeholders: Mapping[str, str] | None = None,
    ) -> Door:
        """The session's door, listening in its sandbox's door directory, with the CAs an
        https client inside should trust beside it."""
        substitution = Substitution(self.secrets, placeholders) if placeholders else None
        door = Door(session_id, owner, policy, self.record, substitution, self.interceptor)
        (directory / CA_BUNDLE).write_bytes(self.ca_bundle)
        await door.open(directory / DOOR_SOCKET)
        return door

    def record(self, record: Record) -> None:
        self._audit.info(json.dumps(record, default=str))
        if self._report is not None:
            self._report(record)

    def close(self) -> None:
        for handler in list(self._audit.handlers):
            handler.close()
            self._audit.removeHandler(handler)


def _ca_bundle(upstream_ca_file: Path | None) -> bytes:
    """The system's CAs, then the policy's upstream_ca_file (a sandbox has no CA store)."""
    paths = ssl.get_default_verify_paths()
    parts = []
    for candidate in (paths.cafile, paths.openssl_cafile, "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            parts.append(Path(candidate).read_bytes())
            break
    else:
        import certifi

        parts.append(Path(certifi.where()).read_bytes())
    if upstream_ca_file is not None:
        parts.append(upstream_ca_file.read_bytes())
    return b"\n".join(parts)
