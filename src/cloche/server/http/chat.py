"""`POST /v1/chat/completions`: a Recursive Language Model behind OpenAI's chat API.

`model: "rlm:<model>"` runs the RLM loop (`cloche.llm.rlm`) in a session: the one named by
the `x-cloche-session-id` header, or a new one, whose id comes back in the same header, so
that a conversation keeps its REPL and its context.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse

from cloche.errors import LLMUnavailable
from cloche.llm.broker import Broker
from cloche.llm.context import put_context_value
from cloche.llm.rlm import RLM
from cloche.server.http.auth import owner_of
from cloche.server.http.models import ChatCompletion, ChatCompletionRequest, ChatMessage, ErrorBody
from cloche.server.jsonbody import JSONBody
from cloche.sessions.manager import SessionManager

log = logging.getLogger("cloche.http")
SESSION_HEADER = "x-cloche-session-id"
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 429, 502, 503)
}
router = APIRouter(tags=["rlm"], responses=ERRORS)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    summary="Answer with a Recursive Language Model (OpenAI-compatible; model rlm:<model>)",
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    owner: str | None = Depends(owner_of),
    x_cloche_session_id: str | None = Header(
        default=None, description="The session to run in; a new one when absent"
    ),
) -> JSONResponse:
    manager: SessionManager = request.app.state.manager
    broker: Broker | None = request.app.state.broker
    if broker is None:
        raise LLMUnavailable(
            "this server has no LLM backend: start it with --llm-base-url and --llm-model"
        )
    query = _text(body.messages[-1])
    if x_cloche_session_id:
        session_id = (await manager.info(x_cloche_session_id, owner)).id
        created = False
    else:
        session_id = (await manager.create(owner)).id
        created = True
    try:
        context = body.context
        if context is None and created:
            context = _text(body.messages[0]) if len(body.messages) == 1 else _dump(body.messages)
        if context is not None:
            await put_context_value(manager, session_id, owner, context)
        rlm = RLM(
            manager,
            broker,
            max_iterations=broker.config.rlm_max_iterations,
            output_chars=broker.config.rlm_output_chars,
        )
        model = body.model.removeprefix("rlm:") or None
        result = await rlm.run(session_id, owner, query, model, gone=request.is_disconnected)
    except BaseException:
        if created:  # its id would never reach the client: don't leave it behind
            await manager.close(session_id, owner, reason="failed-setup")
        raise
    completion = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.answer},
                "finish_reason": "stop" if result.finished else "length",
            }
        ],
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
    }
    return JSONBody(completion, headers={SESSION_HEADER: session_id})


def _text(message: ChatMessage) -> str:
    """A message's text: its content, or the text parts of its content."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", "")) for part in content if part.get("type") == "text")


def _dump(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": message.role, "content": _text(message)} for message in messages]
