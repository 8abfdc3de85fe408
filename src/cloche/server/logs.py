"""How `cloche serve` writes log lines: logfmt-style text, or one JSON object per line.

The text line is `<time> <level> <logger> <message>`, its message carrying `key=value` pairs
(`cell session=... status=ok duration_ms=1.20 count=3`). The JSON line has the same fields,
for log collectors (Fluentd, Vector, Loki): `time` (ISO 8601, UTC), `level`, `logger`,
`message`, each `key=value` pair of the message as a field of its own (numbers as numbers),
and `exception` when the record carries one.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("logfmt", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

_PAIR = re.compile(r"(?<!\S)([a-z_][a-z0-9_]*)=(\S+)")
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?\d+\.\d+")
_RESERVED = frozenset({"time", "level", "logger", "message", "exception"})


def _value(text: str) -> int | float | str:
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


class JSONFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        for key, value in _PAIR.findall(message):
            if key not in _RESERVED:
                line.setdefault(key, _value(value))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


def make_formatter(log_format: str) -> logging.Formatter:
    """The formatter of `--log-format` (logfmt or json)."""
    if log_format == "json":
        return JSONFormatter()
    if log_format == "logfmt":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format {log_format!r}: one of {', '.join(LOG_FORMATS)}")
