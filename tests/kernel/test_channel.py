"""The kernel's channel speaks the host's framing (two implementations, one wire format)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from cloche.kernel.channel import Channel
from cloche.protocol.framing import FrameDecoder, decode_body, encode_frame

MESSAGES = [
    {"op": "ready", "pid": 1234},
    {"op": "stream", "name": "stdout", "text": 'héllo ✓ 🎉\n\x00\t"quoted" \\ back'},
    {"op": "display", "data": {"text/plain": "x", "application/json": {"a": [1, 2.5, None]}}},
    {"op": "done", "status": "ok", "result": None, "error": None, "duration_ms": 0.25},
    {},
]


@dataclass
class Pipes:
    """A kernel Channel, and the host's ends of its two pipes."""

    channel: Channel
    host_write: int  # host -> kernel
    host_read: int  # kernel -> host
    _open: set[int] = field(default_factory=set)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.host_write, view) :]

    def close_host_write(self) -> None:
        os.close(self.host_write)
        self._open.discard(self.host_write)

    def read_available(self) -> bytes:
        os.set_blocking(self.host_read, False)
        chunks = []
        while True:
            try:
                chunk = os.read(self.host_read, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


@pytest.fixture
def pipes() -> Iterator[Pipes]:
    kernel_read, host_write = os.pipe()
    host_read, kernel_write = os.pipe()
    channel = Channel(kernel_read, kernel_write)
    made = Pipes(channel, host_write, host_read, {host_write, host_read, kernel_write})
    yield made
    channel._reader.close()  # the channel owns its read fd and has no close() of its own
    for fd in made._open:
        os.close(fd)


def test_send_does_write_frames_the_host_decodes(pipes):
    for message in MESSAGES:
        pipes.channel.send(message)
    bodies = FrameDecoder(1 << 20).feed(pipes.read_available())
    assert [decode_body(body) for body in bodies] == MESSAGES


def test_send_does_write_the_same_bytes_as_the_hosts_encoder(pipes):
    for message in MESSAGES:
        pipes.channel.send(message)
    assert pipes.read_available() == b"".join(encode_frame(m) for m in MESSAGES)


def test_send_does_keep_a_lone_surrogate_decodable_by_the_host(pipes):
    # User code can put one in an error message: raise ValueError("\ud800").
    message = {"op": "done", "error": {"evalue": "bad \ud800 here", "traceback": ["\udfff"]}}
    pipes.channel.send(message)
    (body,) = FrameDecoder(1 << 20).feed(pipes.read_available())
    assert decode_body(body) == message


def test_send_does_write_a_frame_larger_than_the_pipe_whole(pipes):
    message = {"op": "stream", "name": "stdout", "text": "x" * (1 << 20)}
    received = bytearray()

    def host_reads() -> None:
        while len(received) < len(encode_frame(message)):
            received.extend(os.read(pipes.host_read, 1 << 16))

    reader = threading.Thread(target=host_reads, daemon=True)
    reader.start()
    pipes.channel.send(message)
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert [decode_body(b) for b in FrameDecoder(2 << 20).feed(bytes(received))] == [message]


def test_send_does_not_interleave_frames_from_several_threads(pipes):
    received = bytearray()
    messages = [{"op": "stream", "name": "stdout", "text": f"{n}" * 10_000} for n in range(8)]
    expected_bytes = sum(len(encode_frame(m)) for m in messages)

    def host_reads() -> None:
        while len(received) < expected_bytes:
            received.extend(os.read(pipes.host_read, 1 << 16))

    reader = threading.Thread(target=host_reads, daemon=True)
    reader.start()
    senders = [
        threading.Thread(target=pipes.channel.send, args=(m,), daemon=True) for m in messages
    ]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(timeout=10)
    reader.join(timeout=10)
    got = [decode_body(b) for b in FrameDecoder(1 << 20).feed(bytes(received))]
    assert sorted(got, key=lambda m: m["text"]) == messages


def test_recv_does_return_what_the_host_encoded(pipes):
    pipes.write(b"".join(encode_frame(m) for m in MESSAGES))
    assert [pipes.channel.recv() for _ in MESSAGES] == MESSAGES


def test_recv_does_return_an_exec_message_with_a_lone_surrogate(pipes):
    message = {"op": "exec", "code": "s = '\ud800'", "output_limit": 10}
    pipes.write(encode_frame(message))
    assert pipes.channel.recv() == message


def test_recv_does_wait_for_a_frame_written_a_byte_at_a_time(pipes):
    frame = encode_frame({"op": "exec", "code": "1+1", "output_limit": 1024})

    def host_writes() -> None:
        for i in range(len(frame)):
            pipes.write(frame[i : i + 1])

    writer = threading.Thread(target=host_writes, daemon=True)
    writer.start()
    assert pipes.channel.recv() == {"op": "exec", "code": "1+1", "output_limit": 1024}
    writer.join(timeout=10)


def test_recv_does_return_none_at_end_of_stream(pipes):
    pipes.write(encode_frame({"op": "exec", "code": "1"}))
    pipes.close_host_write()
    assert pipes.channel.recv() == {"op": "exec", "code": "1"}
    assert pipes.channel.recv() is None


@pytest.mark.parametrize("cut", [1, 3, 4, 5, -1])
def test_recv_does_return_none_at_end_of_stream_mid_frame(pipes, cut):
    frame = encode_frame({"op": "exec", "code": "print('cut short')"})
    pipes.write(frame[:cut])
    pipes.close_host_write()
    assert pipes.channel.recv() is None
