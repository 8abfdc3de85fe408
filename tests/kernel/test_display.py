"""MIME bundles and JSON-native values of cell results (see the execution spec, "result")."""

from __future__ import annotations

import base64
import enum
import json
import math

import pytest

from cloche.kernel.display import as_json, is_json_native, mime_bundle, truncate

LIMIT = 1000
PNG = b"\x89PNG\r\n\x1a\n\x00\xff"


class Rich:
    def _repr_html_(self):
        return "<b>rich</b>"

    def _repr_png_(self):
        return PNG

    def _repr_markdown_(self):
        return "**rich**", {"metadata": "is dropped"}

    def _repr_latex_(self):
        return None  # None: not offered

    def __repr__(self):
        return "Rich()"


# mime_bundle


@pytest.mark.parametrize("value", [42, "text", [1, 2], {"a": (1, 2)}, object])
def test_mime_bundle_does_give_the_repr_as_text_plain(value):
    assert mime_bundle(value, LIMIT) == {"text/plain": repr(value)}


def test_mime_bundle_does_pick_up_the_repr_methods_an_object_offers():
    assert mime_bundle(Rich(), LIMIT) == {
        "text/plain": "Rich()",
        "text/html": "<b>rich</b>",
        "text/markdown": "**rich**",
        "image/png": base64.b64encode(PNG).decode("ascii"),
    }


def test_mime_bundle_does_base64_encode_binary_images():
    class Jpeg:
        def _repr_jpeg_(self):
            return bytearray(b"\xff\xd8\xff")

    bundle = mime_bundle(Jpeg(), LIMIT)
    assert base64.b64decode(bundle["image/jpeg"]) == b"\xff\xd8\xff"


def test_mime_bundle_does_decode_bytes_of_text_types():
    class Svg:
        def _repr_svg_(self):
            return b"<svg>\xe2\x9c\x93</svg>"

    assert mime_bundle(Svg(), LIMIT)["image/svg+xml"] == "<svg>✓</svg>"


def test_mime_bundle_does_keep_json_reprs_as_structures():
    class Data:
        def _repr_json_(self):
            return {"a": [1, 2]}

    assert mime_bundle(Data(), LIMIT)["application/json"] == {"a": [1, 2]}


def test_mime_bundle_does_use_repr_mimebundle():
    class Chart:
        def _repr_mimebundle_(self, include=None, exclude=None):
            return {
                "text/plain": "ignored: text/plain is always the repr",
                "text/html": "<div>chart</div>",
                "image/png": PNG,
                "application/vnd.custom+json": {"k": 1},
            }

        def _repr_html_(self):
            return "<div>loses to the mimebundle</div>"

        def __repr__(self):
            return "Chart()"

    assert mime_bundle(Chart(), LIMIT) == {
        "text/plain": "Chart()",
        "text/html": "<div>chart</div>",
        "image/png": base64.b64encode(PNG).decode("ascii"),
        "application/vnd.custom+json": {"k": 1},
    }


def test_mime_bundle_does_leave_out_json_data_that_is_not_json():
    # Sent as it was, it would fail the kernel's reply after the cell, killing the kernel.
    class NotJson:
        def _repr_json_(self):
            return {"a": {1j}}

        def __repr__(self):
            return "NotJson()"

    assert mime_bundle(NotJson(), LIMIT) == {"text/plain": "NotJson()"}


def test_mime_bundle_does_copy_json_data():
    shared = {"a": [1, 2]}

    class Data:
        def _repr_json_(self):
            return shared

    bundle = mime_bundle(Data(), LIMIT)
    shared["a"].append(set())  # later changes by the user's code don't reach the bundle
    assert bundle["application/json"] == {"a": [1, 2]}


@pytest.mark.parametrize(
    "returned",
    [object(), {1j}, {"k": object()}, (), b"\xff\xfe", bytearray(b"ok"), 12, [math.nan], "s"],
)
@pytest.mark.parametrize("method", ["_repr_html_", "_repr_json_", "_repr_png_"])
def test_mime_bundle_does_always_give_what_json_can_send(method, returned):
    value = type("Odd", (), {method: lambda self: returned})()
    json.dumps(mime_bundle(value, LIMIT))  # what the kernel's channel does with it


def test_mime_bundle_does_always_give_what_json_can_send_from_a_mimebundle():
    class Odd:
        def _repr_mimebundle_(self, include=None, exclude=None):
            return {"text/html": object(), "application/x+json": {"k": {1j}}, 5: "not a mime"}

    json.dumps(mime_bundle(Odd(), LIMIT))


def test_mime_bundle_does_take_the_data_of_a_mimebundle_with_metadata():
    class WithMetadata:
        def _repr_mimebundle_(self, include=None, exclude=None):
            return {"text/html": "<p>x</p>"}, {"text/html": {"isolated": True}}

    assert mime_bundle(WithMetadata(), LIMIT)["text/html"] == "<p>x</p>"


def test_mime_bundle_does_ignore_a_raising_repr_html():
    class Broken:
        def _repr_html_(self):
            raise RuntimeError("broken repr")

        def _repr_markdown_(self):
            return "*still here*"

        def __repr__(self):
            return "Broken()"

    assert mime_bundle(Broken(), LIMIT) == {
        "text/plain": "Broken()",
        "text/markdown": "*still here*",
    }


def test_mime_bundle_does_ignore_a_raising_repr_mimebundle():
    class Broken:
        def _repr_mimebundle_(self, include=None, exclude=None):
            raise RuntimeError("broken bundle")

        def _repr_html_(self):
            return "<i>fallback</i>"

    assert mime_bundle(Broken(), LIMIT)["text/html"] == "<i>fallback</i>"


def test_mime_bundle_does_ignore_repr_attributes_that_are_not_methods():
    class Odd:
        _repr_html_ = "<b>not callable</b>"

    assert set(mime_bundle(Odd(), LIMIT)) == {"text/plain"}


def test_mime_bundle_does_not_call_rich_reprs_on_classes():
    assert mime_bundle(Rich, LIMIT) == {"text/plain": repr(Rich)}


def test_mime_bundle_does_let_a_raising_repr_propagate():
    class NoRepr:
        def __repr__(self):
            raise RuntimeError("no repr")

    with pytest.raises(RuntimeError, match="no repr"):
        mime_bundle(NoRepr(), LIMIT)


def test_mime_bundle_does_truncate_text_plain_with_a_marker():
    text = mime_bundle("x" * 100, 10)["text/plain"]
    assert text == "'xxxxxxxxx... [92 more characters]"


# truncate


def test_truncate_does_keep_text_within_the_limit():
    assert truncate("abc", 3) == "abc"


def test_truncate_does_cut_and_say_how_much_was_cut():
    assert truncate("abcdef", 4) == "abcd... [2 more characters]"


# is_json_native


class Colour(enum.IntEnum):
    RED = 1


class Text(str):
    pass


@pytest.mark.parametrize(
    "value",
    [
        0,
        -(10**30),
        1.5,
        -0.0,
        "",
        "é ✓",
        True,
        False,
        None,
        [],
        {},
        [1, "a", None, [True, {"k": 2.5}]],
        {"a": {"b": [1, 2]}, "c": None},
    ],
)
def test_is_json_native_does_accept_json_values(value):
    assert is_json_native(value) is True


@pytest.mark.parametrize(
    "value",
    [
        (1, 2),
        {1, 2},
        frozenset(),
        math.nan,
        math.inf,
        -math.inf,
        [1, math.nan],
        object(),
        b"bytes",
        1j,
        {1: "a"},
        {None: "a"},
        {True: "a"},  # a bool key: JSON would silently make it "true"
        {("a",): 1},
        Colour.RED,  # an int subclass: its repr isn't JSON's
        Text("a"),  # a str subclass
        [Colour.RED],
    ],
)
def test_is_json_native_does_reject_other_values(value):
    assert is_json_native(value) is False


def test_is_json_native_does_treat_bool_as_bool_not_as_an_int_subclass():
    # bool is an int subclass and can't itself be subclassed: it is accepted by its own
    # type check, while other int subclasses are not.
    assert is_json_native([True, 1, False]) is True
    assert is_json_native(Colour.RED) is False
    with pytest.raises(TypeError):
        type("Truthy", (bool,), {})


def test_is_json_native_does_reject_deep_nesting():
    shallow: list[object] = []
    for _ in range(32):
        shallow = [shallow]
    assert is_json_native(shallow) is True
    assert is_json_native([shallow]) is False


def test_is_json_native_does_reject_a_self_referencing_list():
    loop: list[object] = []
    loop.append(loop)
    assert is_json_native(loop) is False


def test_is_json_native_does_reject_too_many_items():
    assert is_json_native(list(range(9_999))) is True
    assert is_json_native(list(range(10_000))) is False
    assert is_json_native({str(i): i for i in range(10_000)}) is False


def test_as_json_does_turn_numpy_scalars_into_numbers(monkeypatch):
    from support import RUNTIME_DIR  # numpy lives in the sandbox runtime, not the server's venv

    monkeypatch.syspath_prepend(str(RUNTIME_DIR))
    import numpy

    assert as_json(numpy.int64(4)) == (True, 4)
    assert as_json(numpy.float32(0.5)) == (True, 0.5)
    assert as_json(numpy.bool_(True)) == (True, True)
    assert as_json(numpy.float64("nan")) == (False, None)
    assert as_json(numpy.array([1, 2])) == (False, None)  # arrays stay reprs
    assert as_json({"a": 1}) == (True, {"a": 1})
    assert as_json({1, 2}) == (False, None)
