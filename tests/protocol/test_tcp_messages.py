"""Requests of the REPL TCP protocol (see the TCP protocol spec, "Request")."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloche.errors import InvalidMessage
from cloche.protocol.framing import decode_body, encode_frame
from cloche.protocol.tcp import GREETING, Request, error_reply, parse_request


def test_parse_request_does_accept_code_alone_as_a_new_session():
    assert parse_request({"code": "1+1"}) == Request(code="1+1")


def test_parse_request_does_accept_empty_code():
    assert parse_request({"code": ""}).code == ""


@pytest.mark.parametrize("message", [{}, {"session_id": None}, {"session_id": ""}])
def test_parse_request_does_read_an_absent_null_or_empty_session_id_as_none(message):
    assert parse_request({"code": "x", **message}).session_id is None


def test_parse_request_does_keep_a_session_id():
    assert parse_request({"code": "x", "session_id": "ab12"}).session_id == "ab12"


@pytest.mark.parametrize(("timeout", "expected"), [(5, 5.0), (0.25, 0.25), (1e300, 1e300)])
def test_parse_request_does_accept_a_positive_timeout_as_float_seconds(timeout, expected):
    request = parse_request({"code": "x", "timeout": timeout})
    assert request.timeout_s == expected
    assert type(request.timeout_s) is float


def test_parse_request_does_read_a_null_timeout_as_none():
    assert parse_request({"code": "x", "timeout": None}).timeout_s is None


def test_parse_request_does_keep_a_token():
    given = "tok-1"
    assert parse_request({"code": "x", "token": given}).token == given


def test_parse_request_does_ignore_unknown_fields():
    request = parse_request({"code": "x", "session_id": "s", "colour": [1, 2], "op": None})
    assert request == Request(code="x", session_id="s")


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({}, "code"),
        ({"code": None}, "code"),
        ({"code": 1}, "code"),
        ({"code": ["print(1)"]}, "code"),
        ({"code": b"1"}, "code"),
        ({"code": "x", "session_id": 5}, "session_id"),
        ({"code": "x", "session_id": ["a"]}, "session_id"),
        ({"code": "x", "session_id": False}, "session_id"),
        ({"code": "x", "timeout": True}, "timeout"),
        ({"code": "x", "timeout": False}, "timeout"),
        ({"code": "x", "timeout": 0}, "timeout"),
        ({"code": "x", "timeout": -1}, "timeout"),
        ({"code": "x", "timeout": -0.5}, "timeout"),
        ({"code": "x", "timeout": math.nan}, "timeout"),
        ({"code": "x", "timeout": math.inf}, "timeout"),
        ({"code": "x", "timeout": -math.inf}, "timeout"),
        ({"code": "x", "timeout": "5"}, "timeout"),
        ({"code": "x", "timeout": [5]}, "timeout"),
        ({"code": "x", "timeout": 10**400}, "timeout"),  # a JSON integer too large for a float
        ({"code": "x", "token": 123}, "token"),
        ({"code": "x", "token": {"t": "s"}}, "token"),
    ],
)
def test_parse_request_does_reject_a_wrong_type_naming_the_field(message, field):
    with pytest.raises(InvalidMessage) as caught:
        parse_request(message)
    assert f"'{field}'" in str(caught.value)


def test_parse_request_does_reject_a_huge_integer_timeout_from_the_wire():
    message = decode_body(b'{"code": "x", "timeout": 1' + b"0" * 400 + b"}")
    with pytest.raises(InvalidMessage, match="'timeout'"):
        parse_request(message)


def test_greeting_does_tell_what_to_send():
    assert GREETING["status"] == "ok"
    assert '"code"' in GREETING["message"] and "session_id" in GREETING["message"]
    assert decode_body(encode_frame(GREETING)[4:]) == GREETING


def test_error_reply_does_carry_status_error_and_extra_fields():
    assert error_reply("Session x not found") == {
        "status": "error",
        "error": "Session x not found",
    }
    assert error_reply("boom", session_id="s")["session_id"] == "s"


numbers = (
    st.integers()
    | st.floats()  # NaN and infinities too: Python's json.loads yields them
    | st.sampled_from([0, -1, 2**1024, 10**400, -(10**400)])  # beyond a float's range
)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3)
    ),
    max_leaves=8,
)
known_fields = st.fixed_dictionaries(
    {"code": st.text() | json_values},  # mostly a str, so the other fields get checked
    optional={
        "session_id": st.none() | st.text() | json_values,
        "timeout": st.none() | numbers | json_values,
        "token": st.none() | st.text() | json_values,
    },
)
requests = st.builds(
    lambda unknown, known: {**unknown, **known},
    st.dictionaries(st.text(), json_values, max_size=3),
    known_fields,
)


@given(message=requests)
def test_parse_request_does_return_a_request_or_raise_invalid_message(message):
    try:
        request = parse_request(message)
    except InvalidMessage:
        return
    assert isinstance(request, Request)
    assert request.code == message["code"]
    assert request.session_id is None or request.session_id == message["session_id"]
    assert request.timeout_s is None or (math.isfinite(request.timeout_s) and request.timeout_s > 0)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({}, None),
        ({"template": None}, None),
        ({"template": ""}, None),
        ({"template": "debian"}, "debian"),
    ],
)
def test_parse_request_does_read_a_new_session_s_template(message, expected):
    assert parse_request({"code": "x", **message}).template == expected


def test_parse_request_does_refuse_a_template_that_is_not_a_string():
    with pytest.raises(InvalidMessage, match="'template' must be a string"):
        parse_request({"code": "x", "template": ["debian"]})
