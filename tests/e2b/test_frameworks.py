"""Agent frameworks' E2B executors, unchanged, on cloche (E2B_API_URL, E2B_SANDBOX_URL and
E2B_API_KEY only), each with a scripted model (no LLM) and real gVisor:

- smolagents 1.26.0: `CodeAgent(executor_type="e2b")` (its executor begins with
  `!pip install` of the authorised imports, present in the template: offline);
- openai-agents 0.24.0: its E2B sandbox client (create, exec, files, PTY, pause, snapshot
  of the workspace, close), driven as its SandboxAgent runtime drives it;
- pydantic-ai-harness 0.62.0: its E2B backend (`E2BSandbox`) under an Agent whose model is
  pydantic-ai's FunctionModel, calling the Shell and FileSystem tools.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gvisor, pytest.mark.slow]


def test_smolagents_code_agent_with_the_e2b_executor(e2b_env: dict[str, str]) -> None:
    from smolagents import CodeAgent
    from smolagents.models import ChatMessage, MessageRole, Model

    class Scripted(Model):
        """Answers with one code step, then nothing more is asked."""

        def __init__(self) -> None:
            super().__init__(model_id="scripted")
            self.calls = 0

        def generate(self, messages: list[Any], **kwargs: Any) -> ChatMessage:
            self.calls += 1
            code = (
                "import numpy\n"
                "value = int(numpy.array([6, 7]).prod())\n"
                "print('computed', value)\n"
                "final_answer(value)\n"
            )
            content = f"Thought: multiply in the sandbox.\n<code>\n{code}</code>"
            return ChatMessage(role=MessageRole.ASSISTANT, content=content)

    model = Scripted()
    with CodeAgent(
        tools=[],
        model=model,
        executor_type="e2b",
        additional_authorized_imports=["numpy"],
        max_steps=2,
    ) as agent:
        answer = agent.run("What is 6 times 7?")
        sandbox = agent.python_executor.sandbox
        assert sandbox.run_code("value").text == "42"  # it ran in the E2B (cloche) sandbox
    assert answer == 42
    assert model.calls == 1


async def test_openai_agents_e2b_sandbox_client(e2b_env: dict[str, str]) -> None:
    from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
    from e2b import NotFoundException
    from e2b_code_interpreter import AsyncSandbox

    client = E2BSandboxClient()
    options = E2BSandboxClientOptions(sandbox_type="e2b_code_interpreter", pause_on_exit=True)
    session = await client.create(options=options)
    sandbox_id = session._inner.state.sandbox_id
    await session.start()  # its workspace (/workspace) is made through the Files API
    try:
        result = await session.exec("echo hello from $(pwd)")
        assert result.ok() and result.stdout.decode().startswith("hello from /workspace")
        failed = await session.exec("exit 7")
        assert failed.exit_code == 7
        await session.write(Path("notes/a.txt"), io.BytesIO(b"written by the agent"))
        assert (await session.read(Path("notes/a.txt"))).read() == b"written by the agent"
        # A terminal is E2B's login shell with the command typed in: it answers, then the
        # shell waits for more, as on E2B, until it is told to exit.
        update = await session.pty_exec_start("python3", "-c", "print(6*7)", tty=True)
        output = update.output
        assert update.process_id is not None
        while b"42" not in output and update.exit_code is None:
            update = await session.pty_write_stdin(session_id=update.process_id, chars="")
            output += update.output
        assert b"42" in output
        update = await session.pty_write_stdin(session_id=update.process_id, chars="exit\n")
        while update.exit_code is None and update.process_id is not None:
            update = await session.pty_write_stdin(session_id=update.process_id, chars="")
        assert update.exit_code == 0
        archive = await session.persist_workspace()  # the workspace's snapshot, as a tar
        assert len(archive.read()) > 0
        assert await session.running()
    finally:
        await session.shutdown()  # pause_on_exit: paused, not killed
    info = await AsyncSandbox.get_info(sandbox_id)
    assert info.state.value == "paused"
    resumed = await client.resume(session._inner.state)
    await resumed.start()
    assert (await resumed.read(Path("notes/a.txt"))).read() == b"written by the agent"
    resumed._inner.state.pause_on_exit = False
    await resumed.shutdown()  # killed
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(sandbox_id)


async def test_pydantic_ai_harness_e2b_backend(e2b_env: dict[str, str]) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai_harness.e2b_sandbox import E2BSandbox
    from pydantic_ai_harness.filesystem import FileSystem
    from pydantic_ai_harness.shell import Shell

    said: list[str] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        names = [tool.name for tool in info.function_tools]
        turn = sum(1 for m in messages if m.kind == "response")
        for message in messages:
            for part in getattr(message, "parts", []):
                if part.part_kind == "tool-return":
                    said.append(str(part.content))
        if turn == 0:
            write = next(n for n in names if "write" in n)
            return ModelResponse(
                parts=[ToolCallPart(write, {"path": "hello.py", "content": "print(6 * 7)\n"})]
            )
        if turn == 1:
            run = (
                "run_command" if "run_command" in names else next(n for n in names if "shell" in n)
            )
            return ModelResponse(parts=[ToolCallPart(run, {"command": "python3 hello.py"})])
        return ModelResponse(parts=[TextPart("done")])

    backend = E2BSandbox()
    agent = Agent(FunctionModel(script), capabilities=[backend, Shell(), FileSystem()])
    result = await agent.run("Write hello.py and run it.")
    assert result.output == "done"
    assert any("42" in text for text in said), said
    sandbox = await backend.get_sandbox() if hasattr(backend, "get_sandbox") else None
    if sandbox is not None:
        assert (await sandbox.files.read("/home/user/hello.py")).strip() == "print(6 * 7)"
        await sandbox.kill()
