"""The fields of a kernel's messages, checked: each one as the host takes it, or InvalidMessage.

Whatever the kernel sends is untrusted (the user's code shares its process and can write
anything to the channel): a malformed field raises, and the kernel loses its sandbox.
"""

from __future__ import annotations

from typing import Any

from cloche.errors import InvalidMessage

_INPUT_KEYS = frozenset({"op", "id", "prompt", "password"})


def parse_number(value: Any, kind: type[int] | type[float]) -> Any:
    """A count or a duration (0 when absent), as `kind`."""
    if value is None:
        return kind(0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidMessage("malformed number")
    return kind(value)


def parse_mime_bundle(data: Any) -> dict[str, Any]:
    """A display's or a result's data: MIME types to their values, text/plain a string."""
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise InvalidMessage("malformed MIME bundle")
    if not isinstance(data.get("text/plain", ""), str):
        raise InvalidMessage("malformed text/plain")
    return data


def parse_result(value: Any) -> dict[str, Any] | None:
    """The cell's last expression: its MIME bundle, and its JSON when it has one."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"data", "json"}:
        raise InvalidMessage("malformed result")
    result = {"data": parse_mime_bundle(value.get("data"))}
    if "json" in value:
        result["json"] = value["json"]
    return result


def parse_error(value: Any) -> dict[str, Any]:
    """The exception the cell raised: ename, evalue and its traceback's lines."""
    if not isinstance(value, dict):
        raise InvalidMessage("malformed error")
    ename, evalue, tb = value.get("ename"), value.get("evalue"), value.get("traceback")
    if not (
        isinstance(ename, str)
        and isinstance(evalue, str)
        and isinstance(tb, list)
        and all(isinstance(line, str) for line in tb)
    ):
        raise InvalidMessage("malformed error")
    return {"ename": ename, "evalue": evalue, "traceback": tb}


def parse_input_request(message: dict[str, Any]) -> tuple[int, str, bool]:
    """An `input()` of the cell asking its client: (id, prompt, password)."""
    request_id, prompt = message.get("id"), message.get("prompt")
    if not _INPUT_KEYS.issuperset(message):
        raise InvalidMessage("an input request outside a cell, or with unknown fields")
    if type(request_id) is not int or not isinstance(prompt, str) or len(prompt) > 1 << 16:
        raise InvalidMessage("malformed input request")
    return request_id, prompt, message.get("password") is True
