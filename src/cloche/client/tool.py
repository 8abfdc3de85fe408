"""How a language model is told about cloche: one `run_python` tool (OpenAI function calling).

The MCP server describes its `run_python` tool with the same words.
"""

from __future__ import annotations

from typing import Any, Literal

TOOL_NAME = "run_python"
RUN_PYTHON_DESCRIPTION = (
    "Run Python code in a persistent, sandboxed Python interpreter (a gVisor sandbox with no "
    "network). Variables, imports and files persist from one call to the next, as in a "
    "Jupyter notebook. Returns what the code printed (stdout, stderr), the value of its last "
    "expression, and the traceback of any exception. numpy, pandas, matplotlib, scipy and "
    "sympy can be imported; matplotlib figures come back as images. Files live in the "
    "working directory."
)
CODE_DESCRIPTION = "The Python code to run. The value of a final expression is returned."


def tool_schema(style: Literal["chat", "responses"] = "chat") -> dict[str, Any]:
    """An OpenAI function-calling definition of the `run_python` tool.

    Args:
        style: `chat` for the Chat Completions API's `tools=[...]`
            (`{"type": "function", "function": {...}}`), or `responses` for the Responses
            API's flatter shape.

    Returns:
        The definition, ready for `tools=[tool_schema()]`; its only argument is `code`.
    """
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": CODE_DESCRIPTION}},
        "required": ["code"],
        "additionalProperties": False,
    }
    function = {
        "name": TOOL_NAME,
        "description": RUN_PYTHON_DESCRIPTION,
        "parameters": parameters,
        "strict": True,
    }
    if style == "responses":
        return {"type": "function", **function}
    return {"type": "function", "function": function}
