"""`cloche serve --log-format json`: one JSON object per line, for log collectors."""

from __future__ import annotations

import json
import logging
import signal
import sys

import pytest

from cloche.cli import build_parser
from cloche.server.logs import JSONFormatter, make_formatter
from support import ServerProcess, require_gvisor


def record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            exc_info = sys.exc_info()
    return logging.LogRecord("cloche.sessions", logging.INFO, __file__, 1, message, args, exc_info)


def test_a_json_line_has_the_fields_of_the_text_line_and_its_pairs() -> None:
    made = record("cell session=%s status=%s duration_ms=%.2f count=%d", "ab12", "ok", 1.5, 3)
    line = JSONFormatter().format(made)
    assert "\n" not in line
    fields = json.loads(line)
    assert fields["level"] == "INFO"
    assert fields["logger"] == "cloche.sessions"
    assert fields["message"] == "cell session=ab12 status=ok duration_ms=1.50 count=3"
    assert fields["time"].endswith("+00:00")
    assert (fields["session"], fields["status"]) == ("ab12", "ok")
    assert (fields["duration_ms"], fields["count"]) == (1.5, 3)


def test_a_pair_cant_overwrite_the_line_s_own_fields() -> None:
    fields = json.loads(JSONFormatter().format(record("odd level=%s message=%s", "x", "y")))
    assert fields["level"] == "INFO"
    assert fields["message"] == "odd level=x message=y"


def test_an_exception_is_one_field_of_the_one_line() -> None:
    line = JSONFormatter().format(record("request failed: %s", "boom", exc=True))
    assert "\n" not in line
    assert "RuntimeError: boom" in json.loads(line)["exception"]


def test_logfmt_stays_today_s_text_line() -> None:
    text = make_formatter("logfmt").format(record("session end id=%s", "ab12"))
    assert text.endswith(" INFO cloche.sessions session end id=ab12")


def test_log_format_is_a_flag_and_an_environment_variable(monkeypatch) -> None:
    monkeypatch.delenv("CLOCHE_LOG_FORMAT", raising=False)
    assert build_parser().parse_args(["serve"]).log_format == "logfmt"
    assert build_parser().parse_args(["serve", "--log-format", "json"]).log_format == "json"
    monkeypatch.setenv("CLOCHE_LOG_FORMAT", "json")
    assert build_parser().parse_args(["serve"]).log_format == "json"
    monkeypatch.setenv("CLOCHE_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])


def test_a_server_with_cloche_log_format_json_writes_only_json_lines(tmp_path) -> None:
    require_gvisor()
    # At debug level: routine cells' lines are debug ones, and every library's lines count.
    env = {"CLOCHE_LOG_FORMAT": "json", "CLOCHE_LOG_LEVEL": "debug"}
    server = ServerProcess(tmp_path / "state", env=env)
    with server.client() as c:
        sid = c.run("x = 1")["session_id"]
        assert c.run("x + 1", sid)["output"] == "2\n"
    assert server.stop(signal.SIGTERM) == 0
    lines = [json.loads(line) for line in server.log if line.strip()]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    cells = [line for line in lines if line["message"].startswith("cell ")]
    assert [(cell["session"], cell["status"], cell["count"]) for cell in cells] == [
        (sid, "ok", 1),
        (sid, "ok", 2),
    ]
    assert all(isinstance(cell["duration_ms"], float) for cell in cells)
    listening = next(line for line in lines if line["message"].startswith("cloche listening"))
    assert listening["tcp"].endswith(f":{server.tcp_port}")
    assert lines[-1]["message"] == "stopped"
