"""`{expr}` and `$name` in a shell command or a magic's line, expanded as IPython does.

As IPython's `var_expand`: `{expr}` is evaluated in the cell's namespace, `$name` (and
`$name.attr`) is replaced when the name is a variable there, `$$name` is a literal
`$name`, and anything else (`$HOME`, `$((1+1))`, `{}` of `find -exec`, an expression that
fails) is passed to the shell unchanged. Unlike IPython, a piece that can't be expanded
leaves only itself as written, not the whole line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

_DOLLAR = re.compile(
    r"\$(\$[\w.]+|[A-Za-z_]\w*(?:\.\w+)*)"
    r"(?=(?:[^']*'[^']*')*[^']*$)"  # not inside single quotes (an even number follow)
)
_CONVERSIONS: dict[str, Callable[[Any], str]] = {"r": repr, "s": str, "a": ascii}


def expand(command: str, namespace: Mapping[str, Any]) -> str:
    """`{expr}` and `$name` of a shell command expanded (see the module's docstring)."""
    import string  # here: the kernel starts without it

    try:
        pieces = list(string.Formatter().parse(command))
    except ValueError:  # a lone `}` or `{`: braces are the shell's
        return _expand_names(command, namespace)
    out: list[str] = []
    for literal, field, spec, conversion in pieces:
        out.append(_expand_names(literal, namespace))
        if field is not None:
            out.append(_expand_field(field, spec or "", conversion, namespace))
    return "".join(out)


def _expand_field(field: str, spec: str, conversion: str | None, ns: Mapping[str, Any]) -> str:
    # As IPython's FullEvalFormatter: `{x[1:3]}` is parsed as field `x[1` and spec `3]`.
    expression = f"{field}:{spec}" if spec else field
    try:
        value = eval(expression, dict(ns))  # noqa: S307  # the user's own expression
        if conversion:
            value = _CONVERSIONS[conversion](value)
        return format(value, "")
    except Exception:
        shown = f"!{conversion}" if conversion else ""
        return "{" + field + shown + (f":{spec}" if spec else "") + "}"


def _expand_names(text: str, namespace: Mapping[str, Any]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match[1]
        if name.startswith("$"):
            return name  # `$$name` is `$name`, for the shell
        parts = name.split(".")
        if parts[0] not in namespace:
            return match[0]
        value = namespace[parts[0]]
        used = 1
        for attribute in parts[1:]:
            try:
                value = getattr(value, attribute)
            except Exception:
                break
            used += 1
        try:
            shown = format(value, "")
        except Exception:
            return match[0]
        return shown + "".join("." + part for part in parts[used:])

    return _DOLLAR.sub(replace, text)
