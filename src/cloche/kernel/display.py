"""MIME bundles for values, as Jupyter shows them, and JSON for JSON-native values."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

# (method, MIME type) pairs an object may offer, as in IPython's formatters.
_REPR_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
)
_BINARY = {"image/png", "image/jpeg"}
_JSON_MAX_ITEMS = 10_000
_JSON_MAX_DEPTH = 32


def truncate(text: str, limit_chars: int) -> str:
    """The text, cut to limit_chars with a marker saying how much was cut."""
    if len(text) <= limit_chars:
        return text
    return f"{text[:limit_chars]}... [{len(text) - limit_chars} more characters]"


def mime_bundle(value: Any, limit_chars: int) -> dict[str, Any]:
    """{mime: data} for a value: always text/plain, plus the reprs it offers."""
    bundle: dict[str, Any] = {"text/plain": truncate(repr(value), limit_chars)}
    if isinstance(value, type):
        return bundle
    custom = getattr(value, "_repr_mimebundle_", None)
    if callable(custom):
        try:
            offered = custom()
            if isinstance(offered, tuple):
                offered = offered[0]
            if isinstance(offered, dict):
                for mime, data in offered.items():
                    if isinstance(mime, str) and mime != "text/plain":
                        bundle[mime] = _encode(mime, data)
        except Exception:  # noqa: S110  # a broken repr hook must not break the cell
            pass
    for method_name, mime in _REPR_METHODS:
        if mime in bundle:
            continue
        method = getattr(value, method_name, None)
        if not callable(method):
            continue
        try:
            data = method()
            if isinstance(data, tuple):
                data = data[0]
            if data is not None:
                bundle[mime] = _encode(mime, data)
        except Exception:  # noqa: S110  # as above
            pass
    return bundle


def _encode(mime: str, data: Any) -> Any:
    if mime in _BINARY and isinstance(data, bytes | bytearray):
        return base64.b64encode(data).decode("ascii")
    if isinstance(data, bytes | bytearray):
        return bytes(data).decode("utf-8", "replace")
    if mime == "application/json" or mime.endswith("+json"):
        # A copy of exactly what the channel will send: data that isn't JSON raises here,
        # and is left out, instead of failing the kernel's reply after the cell.
        return json.loads(json.dumps(data))
    if isinstance(data, str):
        return data
    return str(data)


def as_json(value: Any) -> tuple[bool, Any]:
    """(True, the value as JSON) for JSON-native values and numpy scalars, else (False, None).

    A numpy scalar (what `df.a.sum()` gives) counts as the number it holds.
    """
    kind = type(value)
    if kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        try:
            value = value.item()
        except Exception:
            return False, None
    return (True, value) if is_json_native(value) else (False, None)


def is_json_native(value: Any) -> bool:
    """True for numbers, strings, bools and lists/dicts of those (small enough to send)."""
    budget = [_JSON_MAX_ITEMS]

    def check(item: Any, depth: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0 or depth > _JSON_MAX_DEPTH:
            return False
        kind = type(item)
        if kind is str or kind is int or kind is bool or item is None:
            return True
        if kind is float:
            return math.isfinite(item)
        if kind is list:
            return all(check(x, depth + 1) for x in item)
        if kind is dict:
            return all(type(k) is str and check(v, depth + 1) for k, v in item.items())
        return False

    return check(value, 0)
