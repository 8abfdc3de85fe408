"""What a cell produced, made ready for a page: every output is untrusted.

Text is left as text (the templates escape it). HTML and SVG are shown only inside an
`<iframe sandbox>` without `allow-same-origin` or `allow-scripts` (a document of an opaque
origin that runs nothing, under the page's CSP too); PNG and JPEG only as `data:` images
whose payload is checked to be base64.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

OutputKind = Literal["stdout", "stderr", "text", "frame", "image", "error", "note"]
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_IMAGES = ("image/png", "image/jpeg")
_FRAMED = ("text/html", "image/svg+xml")
_TEXTS = ("text/markdown", "text/latex", "text/plain")


@dataclass(frozen=True)
class Output:
    """One piece of a cell's output, as a template shows it."""

    kind: OutputKind
    text: str = ""  # the text, or the framed document (escaped into srcdoc by the template)
    mime: str = ""
    src: str = ""  # an image's data: URL


@dataclass(frozen=True)
class CellView:
    """One cell of a session's history."""

    number: int | None  # its place in the session's life (the history's), if kept
    execution_count: int
    code: str
    status: str
    end_reason: str | None
    started_at: float | None
    duration_s: float | None
    outputs: list[Output]
    files_changed: list[str]
    front_end: str | None
    running: bool = False


def cell_view(entry: dict[str, Any], *, running: bool = False) -> CellView:
    """A history entry (the shape of the manager's `to_json()`) as a page shows it."""
    outputs: list[Output] = []
    if entry.get("stdout"):
        outputs.append(Output("stdout", _plain(str(entry["stdout"]))))
    if entry.get("stderr"):
        outputs.append(Output("stderr", _plain(str(entry["stderr"]))))
    for bundle in entry.get("displays") or ():
        outputs.extend(rich(bundle))
    if entry.get("result") is not None:
        outputs.extend(rich(entry["result"]))
    error = entry.get("error")
    if isinstance(error, dict):
        lines = error.get("traceback") or [f"{error.get('ename', '')}: {error.get('evalue', '')}"]
        outputs.append(Output("error", _plain("\n".join(str(line) for line in lines))))
    if entry.get("message"):
        outputs.append(Output("note", str(entry["message"])))
    duration = entry.get("duration_s")
    started = entry.get("started_at")
    number = entry.get("number")
    return CellView(
        number=number if isinstance(number, int) else None,
        execution_count=int(entry.get("execution_count") or 0),
        code=str(entry.get("code", "")),
        status=str(entry.get("status", "")),
        end_reason=_optional_text(entry.get("end_reason")),
        started_at=float(started) if isinstance(started, int | float) else None,
        duration_s=float(duration) if isinstance(duration, int | float) else None,
        outputs=outputs,
        files_changed=[str(path) for path in entry.get("files_changed") or ()],
        front_end=_optional_text(entry.get("front_end")),
        running=running,
    )


def rich(bundle: Any) -> list[Output]:
    """The one output Jupyter would show of a MIME bundle ({mime: data}, or {"data": ...})."""
    if isinstance(bundle, dict) and isinstance(bundle.get("data"), dict):
        bundle = bundle["data"]
    if not isinstance(bundle, dict):
        return [Output("text", str(bundle))]
    for mime in _FRAMED:
        if isinstance(bundle.get(mime), str):
            return [Output("frame", bundle[mime], mime)]
    for mime in _IMAGES:
        data = bundle.get(mime)
        if isinstance(data, str):
            payload = "".join(data.split())
            if _BASE64.fullmatch(payload):
                return [Output("image", mime=mime, src=f"data:{mime};base64,{payload}")]
    if "application/json" in bundle:
        return [
            Output("text", json.dumps(bundle["application/json"], indent=2), "application/json")
        ]
    for mime in _TEXTS:
        if mime in bundle:
            return [Output("text", _plain(str(bundle[mime])), mime)]
    return []


def _plain(text: str) -> str:
    """Text without terminal colour codes (tracebacks carry them)."""
    return _ANSI.sub("", text)


def _optional_text(value: Any) -> str | None:
    return None if value is None else str(value)
