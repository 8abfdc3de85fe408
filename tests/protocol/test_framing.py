"""Length-prefixed JSON frames (see the TCP protocol spec, "Framing")."""

from __future__ import annotations

import asyncio
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloche.errors import FrameTooLarge, IncompleteRead, InvalidMessage
from cloche.protocol.framing import FrameDecoder, decode_body, encode_frame, read_body

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=10,
)
json_objects = st.dictionaries(st.text(), json_values, max_size=5)


def header(length: int) -> bytes:
    return struct.pack(">I", length)


def reader_of(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


# encode_frame / decode_body


def test_encode_frame_does_prefix_the_body_with_its_big_endian_length():
    frame = encode_frame({"code": "1+1"})
    body = b'{"code":"1+1"}'
    assert frame == header(len(body)) + body


def test_encode_frame_does_write_non_ascii_as_utf8():
    frame = encode_frame({"text": "héllo ✓ 🎉"})
    assert frame[4:].decode("utf-8") == '{"text":"héllo ✓ 🎉"}'


def test_encode_frame_then_decode_body_does_round_trip():
    message = {"code": "print('é')", "session_id": None, "timeout": 1.5, "n": [1, {"a": True}]}
    frame = encode_frame(message)
    assert decode_body(frame[4:]) == message


def test_encode_frame_does_keep_a_lone_surrogate_as_valid_utf8():
    # User code can make such a str (e.g. raise ValueError("\ud800")); it must not break
    # the frame for a peer that decodes strict UTF-8.
    frame = encode_frame({"evalue": "a\ud800b\\\udfff"})
    frame[4:].decode("utf-8")  # strict: raises if the body is not UTF-8
    assert decode_body(frame[4:]) == {"evalue": "a\ud800b\\\udfff"}


def test_decode_body_does_reject_invalid_utf8():
    with pytest.raises(InvalidMessage, match="Invalid JSON format"):
        decode_body(b'{"code": "\xff"}')


def test_decode_body_does_reject_invalid_json():
    with pytest.raises(InvalidMessage, match="Invalid JSON format"):
        decode_body(b'{"code": ')


def test_decode_body_does_reject_an_empty_body():
    with pytest.raises(InvalidMessage):
        decode_body(b"")


@pytest.mark.parametrize("body", [b"[]", b'"code"', b"1", b"null", b"true"])
def test_decode_body_does_reject_json_that_is_not_an_object(body):
    with pytest.raises(InvalidMessage, match="must be a JSON object"):
        decode_body(body)


# FrameDecoder


def test_frame_decoder_does_return_a_frame_split_at_every_byte_boundary():
    first, second = encode_frame({"code": "x = 'é'"}), encode_frame({"code": "y"})
    frames = first + second
    expected = [first[4:], second[4:]]
    for cut in range(len(frames) + 1):
        decoder = FrameDecoder(1024)
        bodies = decoder.feed(frames[:cut]) + decoder.feed(frames[cut:])
        assert bodies == expected, cut
        assert decoder.pending_bytes == 0


def test_frame_decoder_does_return_a_frame_fed_one_byte_at_a_time():
    frame = encode_frame({"code": "1+1"})
    decoder = FrameDecoder(1024)
    bodies = [body for i in range(len(frame)) for body in decoder.feed(frame[i : i + 1])]
    assert bodies == [frame[4:]]


def test_frame_decoder_does_return_several_frames_from_one_chunk():
    messages = [{"n": n} for n in range(5)]
    decoder = FrameDecoder(1024)
    bodies = decoder.feed(b"".join(encode_frame(m) for m in messages))
    assert [decode_body(b) for b in bodies] == messages


def test_frame_decoder_does_keep_a_partial_frame_pending():
    frame = encode_frame({"code": "1+1"})
    decoder = FrameDecoder(1024)
    assert decoder.feed(frame + frame[:6]) == [frame[4:]]
    assert decoder.pending_bytes == 6
    assert decoder.feed(frame[6:]) == [frame[4:]]
    assert decoder.pending_bytes == 0


def test_frame_decoder_does_accept_an_empty_body():
    assert FrameDecoder(0).feed(header(0)) == [b""]


def test_frame_decoder_does_accept_a_frame_of_exactly_the_limit():
    assert FrameDecoder(3).feed(header(3) + b"abc") == [b"abc"]


def test_frame_decoder_does_raise_frame_too_large_on_the_header_alone():
    decoder = FrameDecoder(1024)
    with pytest.raises(FrameTooLarge) as caught:
        decoder.feed(header(1025))
    assert (caught.value.length, caught.value.limit) == (1025, 1024)
    assert "1025" in str(caught.value) and "1024" in str(caught.value)


def test_frame_decoder_does_raise_frame_too_large_on_the_largest_declared_length():
    with pytest.raises(FrameTooLarge):
        FrameDecoder(16 * 1024 * 1024).feed(b"\xff\xff\xff\xff")


def test_frame_decoder_does_raise_frame_too_large_after_good_frames_in_the_same_chunk():
    decoder = FrameDecoder(1024)
    with pytest.raises(FrameTooLarge):
        decoder.feed(encode_frame({"a": 1}) + header(2048))


@given(
    messages=st.lists(json_objects, max_size=6),
    cuts=st.lists(st.integers(min_value=0), max_size=10),
)
def test_frame_decoder_does_return_the_same_bodies_whatever_the_chunking(messages, cuts):
    frames = [encode_frame(m) for m in messages]
    stream = b"".join(frames)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    decoder = FrameDecoder(1 << 20)
    bodies = []
    for start, end in zip(points, points[1:], strict=False):
        bodies += decoder.feed(stream[start:end])
    assert bodies == [f[4:] for f in frames]
    assert [decode_body(b) for b in bodies] == messages
    assert decoder.pending_bytes == 0


frame_like = st.binary(max_size=40).map(lambda body: header(len(body)) + body)


@given(
    pieces=st.lists(st.binary(max_size=40) | frame_like, max_size=10),
    cuts=st.lists(st.integers(min_value=0), max_size=10),
    limit=st.integers(min_value=0, max_value=48),
)
def test_frame_decoder_does_only_return_bodies_or_raise_frame_too_large(pieces, cuts, limit):
    stream = b"".join(pieces)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    decoder = FrameDecoder(limit)
    bodies = []
    try:
        for start, end in zip(points, points[1:], strict=False):
            bodies += decoder.feed(stream[start:end])
    except FrameTooLarge as exc:
        assert exc.length > limit
        return
    assert all(len(body) <= limit for body in bodies)
    assert decoder.pending_bytes < 4 + limit
    assert FrameDecoder(limit).feed(stream) == bodies  # chunking changes nothing


# read_body


async def test_read_body_does_return_the_body_of_one_frame():
    reader = reader_of(encode_frame({"code": "1+1"}) + encode_frame({"code": "2"}))
    assert await read_body(reader, 1024) == b'{"code":"1+1"}'
    assert await read_body(reader, 1024) == b'{"code":"2"}'


async def test_read_body_does_return_none_on_a_clean_end_of_stream():
    reader = reader_of(encode_frame({"a": 1}))
    assert await read_body(reader, 1024) == b'{"a":1}'
    assert await read_body(reader, 1024) is None


async def test_read_body_does_return_none_on_an_empty_stream():
    assert await read_body(reader_of(b""), 1024) is None


@pytest.mark.parametrize("partial", [b"\x00", b"\x00\x00\x00"])
async def test_read_body_does_raise_incomplete_read_mid_header(partial):
    with pytest.raises(IncompleteRead, match="header"):
        await read_body(reader_of(partial), 1024)


async def test_read_body_does_raise_incomplete_read_mid_body():
    with pytest.raises(IncompleteRead, match="3 of 10 body bytes"):
        await read_body(reader_of(header(10) + b"abc"), 1024)


async def test_read_body_does_raise_frame_too_large_without_waiting_for_the_body():
    reader = reader_of(header(2048), eof=False)  # no body will ever come
    with pytest.raises(FrameTooLarge) as caught:
        await asyncio.wait_for(read_body(reader, 1024), timeout=5)
    assert (caught.value.length, caught.value.limit) == (2048, 1024)


async def test_read_body_does_wait_for_a_frame_that_arrives_in_pieces():
    reader = asyncio.StreamReader()
    frame = encode_frame({"code": "1+1"})
    task = asyncio.ensure_future(read_body(reader, 1024))
    for i in range(len(frame)):
        await asyncio.sleep(0)
        assert not task.done()
        reader.feed_data(frame[i : i + 1])
    assert await task == frame[4:]
