"""What the sessions are handed to reach the layers above them from a kernel's channel.

Sessions never import the language-model layer: it sits above them (its RLM loop runs
cells). Whoever made the broker hands it down as an `LLMHookup` (`cloche.llm.bridge`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cloche.sandbox.layers import System


class Channel(Protocol):
    """What a hookup needs of a kernel's channel (`KernelClient`)."""

    def hold_deadline(self, cell: Any, held: bool) -> None: ...

    def send(self, message: dict[str, Any]) -> None: ...


class LLMRequests(Protocol):
    """The host's side of one kernel's `llm_query` requests (`cloche.llm.bridge`)."""

    def request(self, cell: object, message: dict[str, Any]) -> None:
        """A request of the running cell: answer it when the model has."""

    def stop(self, cell: object, why: str, *, interrupted: bool = False) -> None:
        """The cell is stopping: answer its requests in flight with why."""

    def end(self, cell: object) -> None:
        """The cell ended: forget its requests."""


class LLMHookup(Protocol):
    """What a manager is handed to give its sessions `llm_query`: the broker, on the
    server's side of the wall (`cloche.llm.bridge.SessionsLLM`)."""

    setup_code: str  # silent code every new sandbox runs: switches llm_query on

    def for_kernel(self, session_id: str, kernel: Channel) -> LLMRequests:
        """The answerer of one session's kernel, spending that session's budget."""


class TemplateSystems(Protocol):
    """The server's templates, as sessions need them (`cloche.sessions.templates`)."""

    def system(self, name: str) -> System:
        """The system a ready template gives its sandboxes.

        Raises:
            TemplateNotFound, TemplateNotReady, TemplateFailed: it can't serve.
        """
