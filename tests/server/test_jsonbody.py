"""JSON bodies of what sandboxes produce (no server needed)."""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from cloche.server.jsonbody import json_bytes

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def test_a_lone_surrogate_goes_out_as_its_escape_and_comes_back():
    body = json_bytes({"evalue": "a\ud800b\\\udfff", "\udc80": 1})
    body.decode("utf-8")  # valid UTF-8
    assert json.loads(body) == {"evalue": "a\ud800b\\\udfff", "\udc80": 1}


def test_nan_and_the_infinities_become_null_at_any_depth():
    body = json_bytes({"x": [1.5, math.nan, {"y": math.inf}], "z": -math.inf})
    assert json.loads(body) == {"x": [1.5, None, {"y": None}], "z": None}


@given(json_values)
def test_any_value_is_valid_strict_json_that_decodes_to_it(value):
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    assert json.loads(json_bytes(value).decode("utf-8"), parse_constant=refuse) == _finite(value)
