"""Signed, expiring values: what a browser may hold and the server checks without keeping
them (preview tokens, the inspector's cookies).

A signed value is `<payload>.<signature>`, both base64url without padding: the payload is
JSON (the fields given, the purpose and the expiry), the signature HMAC-SHA256 of the
purpose and the payload under the server's key. A value signed for one purpose is refused
for any other, so a preview token is never an inspector cookie and the reverse.

The key is kept in `<data-dir>/signing-key` (0600, made the first time): values signed
before a restart still hold after it, and a new key (the file removed) refuses them all.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloche.errors import ConfigError

log = logging.getLogger("cloche.server")

KEY_FILE = "signing-key"
KEY_BYTES = 32


class BadSignature(Exception):
    """A value that was not signed by this server for this purpose, or is malformed."""


class Expired(BadSignature):
    """A value signed by this server whose time is over."""


class Signer:
    """Signs and checks values with one key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a signing key has at least 16 bytes")
        self._key = key

    @classmethod
    def of_data_dir(cls, data_dir: Path) -> Signer:
        """The server's signer, its key kept in `<data_dir>/signing-key`.

        Raises:
            ConfigError: the file can't be read or written, or holds no key.
        """
        path = data_dir / KEY_FILE
        try:
            data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                kept = path.read_text().strip()
            else:
                kept = secrets.token_hex(KEY_BYTES)
                with os.fdopen(fd, "w") as out:
                    out.write(kept + "\n")
                log.info("signing key made and written to %s (0600)", path)
            return cls(bytes.fromhex(kept))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"can't keep the signing key in {path}: {exc}") from exc

    def sign(self, purpose: str, fields: Mapping[str, Any], expires_at: float) -> str:
        """fields (JSON values), for purpose, good until expires_at (unix time, s)."""
        body = {**fields, "purpose": purpose, "exp": int(expires_at)}
        payload = _b64(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())
        return f"{payload}.{self._mac(purpose, payload)}"

    def verify(self, purpose: str, value: str, now: float | None = None) -> dict[str, Any]:
        """The fields of a value signed for purpose (with `exp`).

        Raises:
            BadSignature: not one of this server's for purpose, or malformed.
            Expired: signed, but its time is over.
        """
        payload, dot, signature = value.partition(".")
        if not dot or not payload or len(value) > 4096:
            raise BadSignature("not a signed value")
        if not hmac.compare_digest(signature.encode(), self._mac(purpose, payload).encode()):
            raise BadSignature("a signature that is not this server's")
        try:
            body = json.loads(_unb64(payload))
        except (ValueError, binascii.Error) as exc:
            raise BadSignature("a malformed payload") from exc
        if not isinstance(body, dict) or body.get("purpose") != purpose:
            raise BadSignature("signed for another purpose")
        expires_at = body.get("exp")
        if type(expires_at) is not int:
            raise BadSignature("a payload without its expiry")
        if (time.time() if now is None else now) >= expires_at:
            raise Expired("expired")
        return body

    def _mac(self, purpose: str, payload: str) -> str:
        signed = f"{purpose}.{payload}".encode()
        return _b64(hmac.digest(self._key, signed, hashlib.sha256))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
