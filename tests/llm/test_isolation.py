"""What llm_query must not open: the key, the endpoint, a way out of the sandbox; and a
hostile kernel's malformed LLM requests, which end only its own session."""

from __future__ import annotations

import pytest

from llm.conftest import KEY
from llm.stub import StubLLM
from support import ServerThread


def run(server: ServerThread, code: str, session_id: str | None = None) -> dict[str, object]:
    with server.client() as client:
        return client.run(code, session_id)


SEARCH = """
import os
needles = [n.encode() for n in {needles!r}]
found = []
def look(path, data):
    for needle in needles:
        if needle in data:
            found.append(path)
for key, value in os.environ.items():
    look('env:' + key, (key + '=' + value).encode())
for pid in ('self', '1'):
    for name in os.listdir(f'/proc/{{pid}}'):
        try:
            with open(f'/proc/{{pid}}/{{name}}', 'rb') as f:
                look(f'/proc/{{pid}}/{{name}}', f.read(1 << 20))
        except OSError:
            pass
for top in ('/etc', '/work', '/tmp', '/opt', '/'):
    for root, dirs, files in os.walk(top):
        if top == '/':
            dirs.clear()
        for name in files:
            try:
                with open(os.path.join(root, name), 'rb') as f:
                    look(os.path.join(root, name), f.read(1 << 22))
            except OSError:
                pass
found
"""


def test_the_key_and_the_endpoint_appear_nowhere_inside(llm_server, stub: StubLLM):
    """After calls were made, search the sandbox's environment, /proc/self, /proc/1 and
    its files for the API key (a canary) and the endpoint's address."""
    session = str(run(llm_server, "llm_query('warm up')")["session_id"])
    needles = [KEY, stub.url, f"127.0.0.1:{stub.port}"]
    # The search itself holds the needles in its source: build them inside, reversed.
    code = SEARCH.format(needles=[n[::-1] for n in needles]).replace(
        "needles = [n.encode()", "needles = [n[::-1].encode()"
    )
    reply = run(llm_server, code, session)
    assert reply["status"] == "ok", reply
    assert reply["output"] == "[]\n"
    assert [r.headers["authorization"] for r in stub.requests] == [f"Bearer {KEY}"]


def test_the_sandbox_cant_reach_the_endpoint_itself(llm_server, stub: StubLLM):
    """Knowing the endpoint's address (as an attacker might guess it), connect to it
    directly from a cell. Outcome: no connection; the endpoint saw no request."""
    code = (
        "import urllib.request\n"
        "try:\n"
        f"    urllib.request.urlopen({stub.url + '/chat/completions'!r}, data=b'{{}}', timeout=3)\n"
        "    outcome = 'reached'\n"
        "except OSError as exc:\n"
        "    outcome = type(exc).__name__\n"
        "outcome"
    )
    reply = run(llm_server, code)
    assert reply["status"] == "ok", reply
    assert reply["output"] != "'reached'\n"
    assert stub.requests == []


FORGE = (
    "import cloche.kernel.llm as m, time\n"
    "channel = m._bridge._channel\n"
    "for message in {messages!r}:\n"
    "    channel.send(message)\n"
    "time.sleep(10)\n"
)

MALFORMED = {
    "prompts not a list": [{"op": "llm", "id": 1, "prompts": "x"}],
    "a prompt not a str": [{"op": "llm", "id": 1, "prompts": [["x"]]}],
    "no prompts": [{"op": "llm", "id": 1, "prompts": []}],
    "too many prompts": [{"op": "llm", "id": 1, "prompts": ["x"] * 1025}],
    "a prompt too long": [{"op": "llm", "id": 1, "prompts": ["x" * 2_000_001]}],
    "id not an int": [{"op": "llm", "id": "1", "prompts": ["x"]}],
    "id a bool": [{"op": "llm", "id": True, "prompts": ["x"]}],
    "id negative": [{"op": "llm", "id": -5, "prompts": ["x"]}],
    "model not a str": [{"op": "llm", "id": 1, "prompts": ["x"], "model": 42}],
    "model too long": [{"op": "llm", "id": 1, "prompts": ["x"], "model": "m" * 201}],
    "unknown field": [{"op": "llm", "id": 1, "prompts": ["x"], "url": "http://evil"}],
    "the same id twice in flight": [
        {"op": "llm", "id": 7, "prompts": ["x"]},
        {"op": "llm", "id": 7, "prompts": ["y"]},
    ],
}


@pytest.mark.parametrize("messages", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_llm_request_ends_only_its_own_session(
    llm_server, stub: StubLLM, messages: list[dict[str, object]]
):
    stub.block()  # a first request stays in flight (for the duplicate id)
    witness = str(run(llm_server, "w = 1")["session_id"])
    reply = run(llm_server, FORGE.format(messages=messages))
    assert reply["cell_status"] == "killed", reply
    assert "broke the channel protocol" in str(reply["error"])
    stub.release()
    assert run(llm_server, "w + 1", witness)["output"] == "2\n"
    assert run(llm_server, "llm_query('still fine')", witness)["output"] == "'echo: still fine'\n"
