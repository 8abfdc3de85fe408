"""input() and getpass.getpass() in a cell: the prompt goes to whoever drives the session.

    kernel -> host  {"op": "input", "id": int, "prompt": str, "password": bool}
    host -> kernel  {"op": "input_reply", "id": int, "value": str}
                    {"op": "input_reply", "id": int, "error": str[, "interrupted": true]}

Only a cell sent by a client that answers prompts (Jupyter's `allow_stdin`, the sessions
API's streamed execute, the SDK with `on_input`) may ask; any other gets
StdinNotImplementedError at once, never a hang. The request goes through the channel's
reader of the cell (`llm.Bridge.ask`); the cell's timeout and interrupts still apply while it
waits: the host then answers "interrupted" and the cell gets KeyboardInterrupt.
"""

from __future__ import annotations

import builtins
import getpass
import sys
import threading
from typing import Any

from .llm import Bridge

MAX_PROMPT_CHARS = 64 * 1024  # a longer prompt is cut (the frame must stay small)


class StdinNotImplementedError(NotImplementedError):
    """input() was called, but the client that sent this cell does not answer prompts."""


StdinNotImplementedError.__module__ = "builtins"  # as the cell sees it


class Prompter:
    """The kernel's input() and getpass(), for one cell at a time."""

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge
        self.allowed = False  # the running cell's client answers prompts

    def install(self) -> None:
        builtins.input = self.input
        getpass.getpass = self.getpass
        builtins.StdinNotImplementedError = StdinNotImplementedError  # type: ignore[attr-defined]

    def input(self, prompt: object = "") -> str:
        """Ask the person (or program) driving the session for a line."""
        return self._ask(str(prompt), password=False)

    def getpass(self, prompt: str = "Password: ", stream: Any = None) -> str:
        """Ask for a line that is not echoed."""
        return self._ask(str(prompt), password=True)

    def _ask(self, prompt: str, *, password: bool) -> str:
        if not self.allowed:
            raise StdinNotImplementedError(
                "input() was called, but this client does not answer prompts (over Jupyter: "
                "allow_stdin; over HTTP: a streamed execute with allow_stdin; the SDK: "
                "on_input=...). Pass the value in the code instead."
            )
        if threading.current_thread() is not threading.main_thread():
            # A thread's prompt could outlive its cell, and with it the client that
            # answers prompts.
            raise StdinNotImplementedError("input() works only in a cell's main thread")
        sys.stdout.flush()
        sys.stderr.flush()
        reply = self._bridge.ask(
            {"op": "input", "prompt": prompt[:MAX_PROMPT_CHARS], "password": password}
        )
        if isinstance(reply.get("error"), str):
            raise StdinNotImplementedError(reply["error"])
        value = reply.get("value")
        return value if isinstance(value, str) else ""
