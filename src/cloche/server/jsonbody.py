"""JSON bodies for what sandboxes produce, which may hold any str and any float.

User code can put a lone surrogate in a str (`raise ValueError("\\ud800")`), which UTF-8
can't encode, and NaN in a rich output (`_repr_json_`), which JSON lacks. Either would
make a plain `json.dumps(...).encode()` raise while the answer is being written, and the
client would get a 500 or a dropped connection instead of its cell's result.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_text(content: Any) -> str:
    """Content as JSON text; NaN and the infinities become null, as pydantic writes them."""
    try:
        return _encoder.encode(content)
    except ValueError:  # a float JSON can't hold: rare, so only then is the copy made
        return _encoder.encode(_finite(content))


def json_bytes(content: Any) -> bytes:
    """Content as UTF-8 JSON. A lone surrogate can only be inside a JSON string, where
    backslashreplace writes it as its JSON escape (`\\ud800`): the body stays valid UTF-8
    and decodes to the same str."""
    return json_text(content).encode("utf-8", "backslashreplace")


def map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """A copy of JSON-shaped content (dicts, lists, tuples) with leaf() applied to every
    value that is neither; keys are kept as they are."""
    if isinstance(value, dict):
        return {key: map_leaves(item, leaf) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [map_leaves(item, leaf) for item in value]
    return leaf(value)


def _finite(value: Any) -> Any:
    return map_leaves(value, lambda x: None if isinstance(x, float) and not math.isfinite(x) else x)


class JSONBody(JSONResponse):
    """A JSON response whose content may come from a sandbox."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)
