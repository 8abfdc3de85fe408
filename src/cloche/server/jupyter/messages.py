"""Jupyter messages on the websocket: the legacy JSON framing, read liberally, written strictly.

One text frame is one message: `{"header", "parent_header", "metadata", "content", "buffers",
"channel", "msg_id", "msg_type"}`. A binary frame is the same JSON preceded by its buffers'
offsets (jupyter_server's legacy binary form); the buffers themselves are dropped.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from cloche.server.jsonbody import json_text

PROTOCOL_VERSION = "5.3"
CHANNELS = ("shell", "control", "iopub", "stdin", "hb")
# Message ids as jupyter_client makes them (unique prefix, count): a uuid4 per message was
# 2% of the server's CPU with 100 busy kernels.
_MSG_IDS = uuid.uuid4().hex
_SENT = itertools.count(1)
_SESSIONS = uuid.UUID("6b1c0c4e-7d0a-4d5e-9a51-0c10c4e0a7a1")  # namespace of header.session


class NotAMessage(ValueError):
    """A frame that is not a Jupyter message in JSON (the connection is closed with 1003)."""


@dataclass(frozen=True)
class Request:
    """A message from a client, as much of it as the gateway reads."""

    channel: str
    msg_type: str
    header: dict[str, Any]
    content: dict[str, Any]

    @property
    def username(self) -> str:
        name = self.header.get("username")
        return name if isinstance(name, str) and name else "cloche"


def parse(text: str | None, data: bytes | None) -> Request | None:
    """The message in a frame; None for a JSON object that names no message type.

    Raises:
        NotAMessage: the frame is not a JSON object.
    """
    if text is None:
        text = _binary_json(data or b"")
    try:
        message = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise NotAMessage(f"the frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise NotAMessage("the frame is not a JSON object")
    header = message.get("header")
    header = header if isinstance(header, dict) else {}
    msg_type = header.get("msg_type", message.get("msg_type"))
    if not isinstance(msg_type, str) or not msg_type:
        return None
    channel = message.get("channel")
    content = message.get("content")
    return Request(
        channel=channel if isinstance(channel, str) and channel else "shell",
        msg_type=msg_type,
        header=header,
        content=content if isinstance(content, dict) else {},
    )


def _binary_json(data: bytes) -> str:
    """The JSON part of a binary frame: a count n, n offsets (uint32, big-endian), then the
    parts; the first part is the message."""
    try:
        (count,) = struct.unpack_from("!I", data)
        offsets = struct.unpack_from(f"!{count}I", data, 4) if 0 < count <= 1024 else ()
        if not offsets:
            raise NotAMessage("a binary frame without parts")
        end = offsets[1] if len(offsets) > 1 else len(data)
        return data[offsets[0] : end].decode("utf-8")
    except (struct.error, UnicodeDecodeError) as exc:
        raise NotAMessage(f"a binary frame that is not Jupyter's: {exc}") from None


@functools.lru_cache(maxsize=4096)  # asked for every message sent: a uuid5 is a SHA-1
def session_of(kernel_id: str, restarts: int = 0) -> str:
    """The `header.session` of a kernel's messages: stable on any connection until the
    kernel restarts (a restart is a new session, as with ipykernel)."""
    return str(uuid.uuid5(_SESSIONS, f"{kernel_id}/{restarts}" if restarts else kernel_id))


def now() -> str:
    """A timestamp as Jupyter writes them (ISO 8601, UTC)."""
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")
    return stamp.removesuffix("+00:00") + "Z"  # isoformat is ~5x cheaper than strftime


def message(
    channel: str,
    msg_type: str,
    content: dict[str, Any],
    parent: Request | None,
    session: str,
) -> dict[str, Any]:
    """A message to send: a fresh header, the request's header as its parent."""
    msg_id = f"{_MSG_IDS}_{next(_SENT)}"
    header = {
        "msg_id": msg_id,
        "msg_type": msg_type,
        "session": session,
        "username": parent.username if parent is not None else "cloche",
        "date": now(),
        "version": PROTOCOL_VERSION,
    }
    return {
        "header": header,
        "parent_header": parent.header if parent is not None else {},
        "metadata": {},
        "content": content,
        "buffers": [],
        "channel": channel,
        "msg_id": msg_id,
        "msg_type": msg_type,
    }


def frame(message: dict[str, Any]) -> str:
    """A message as the text of one frame (any str and float a sandbox produced included)."""
    text = json_text(message)
    if text.isascii():  # nearly always, and then it holds no lone surrogate
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")  # as json_bytes does
