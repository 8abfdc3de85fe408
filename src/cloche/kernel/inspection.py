"""What `obj?` and `obj??` show: IPython's plain-text object info, field by field.

    Signature: f(x, y=1)
    Docstring: Add y to x.
    File:      ~/work/util.py
    Type:      function

`??` shows the source instead of the docstring when there is one. The text is returned, not
printed, so that a Jupyter front end can put it in a `page` payload as IPython does.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import os
import types
from collections.abc import Mapping
from typing import Any

_STRING_MAX = 200  # chars of an object's str() shown, as IPython
_SIGNATURE_WIDTH = 75  # chars of a signature on one line, past which it takes many
_NOT_FOUND = object()
_OBJECT_INIT_DOC = inspect.getdoc(object.__init__)


def find(target: str, namespace: Mapping[str, Any]) -> Any:
    """The object a dotted name stands for in the namespace (or builtins), or `_NOT_FOUND`.

    Only names and attributes are followed: nothing is called or indexed.
    """
    head, *attributes = target.split(".")
    if head in namespace:
        value = namespace[head]
    elif hasattr(builtins, head):
        value = getattr(builtins, head)
    else:
        return _NOT_FOUND
    for attribute in attributes:
        try:
            value = getattr(value, attribute)
        except Exception:
            return _NOT_FOUND
    return value


def object_help(target: str, namespace: Mapping[str, Any], detail_level: int = 0) -> str:
    """The text of `target?` (`detail_level` 0) or `target??` (1)."""
    value = find(target, namespace)
    if value is _NOT_FOUND:
        return f"Object `{target}` not found."
    return describe(value, target, detail_level)


def describe(obj: Any, name: str, detail_level: int = 0) -> str:
    """IPython's info fields for an object, as plain text."""
    fields: list[tuple[str, str | None]] = []
    docstring = _getdoc(obj)
    source = _source(obj) if detail_level else None
    if source is not None and docstring is not None and _has_docstring(source, docstring):
        docstring = None
    elif docstring is None:
        docstring = "<no docstring>"
    if inspect.isclass(obj) or _is_simple_callable(obj):
        init_signature = None
        init_docstring = None
        if inspect.isclass(obj):
            init_signature = _signature(obj, name)
            init_docstring = _getdoc(getattr(obj, "__init__", None))
            if init_docstring == _OBJECT_INIT_DOC:
                init_docstring = None
        fields += [
            ("Signature", None if inspect.isclass(obj) else _signature(obj, name)),
            ("Init signature", init_signature),
            ("Docstring", docstring),
        ]
        if source is not None:
            fields.append(("Source", source))
        else:
            fields.append(("Init docstring", init_docstring))
        fields += [("File", _file(obj)), ("Type", type(obj).__name__)]
        if inspect.isclass(obj):
            fields.append(("Subclasses", _subclasses(obj)))
    else:
        class_docstring = _getdoc(type(obj))
        if class_docstring == docstring or type(obj).__module__ == "builtins":
            class_docstring = None
        init_docstring = _getdoc(getattr(obj, "__init__", None))
        if init_docstring == _OBJECT_INIT_DOC:
            init_docstring = None
        fields += [
            ("Signature", _signature(obj, name) if callable(obj) else None),
            ("Type", type(obj).__name__),
            ("String form", _string_form(obj, detail_level)),
            ("Length", _length(obj)),
            ("File", _file(obj)),
            ("Source", source) if source is not None else ("Docstring", docstring),
            ("Class docstring", class_docstring),
            ("Init docstring", init_docstring),
        ]
    return _format([(title, body) for title, body in fields if body is not None])


def _format(fields: list[tuple[str, str]]) -> str:
    """As IPython's `format_mime`: titles padded to the longest; a body of many lines on
    the lines after its title."""
    if not fields:
        return ""
    width = max(len(title) for title, _ in fields)
    lines = []
    for title, body in fields:
        body = body.strip("\n")
        delimiter = "\n" if "\n" in body else " "
        lines.append(f"{title}:{' ' * (width - len(title))}{delimiter}{body}")
    return "\n".join(lines)


def _is_simple_callable(obj: Any) -> bool:
    return isinstance(
        obj,
        types.FunctionType
        | types.MethodType
        | types.BuiltinFunctionType
        | types.BuiltinMethodType
        | types.MethodDescriptorType
        | types.WrapperDescriptorType
        | types.MethodWrapperType
        | types.ClassMethodDescriptorType,
    )


def _getdoc(obj: Any) -> str | None:
    try:
        return inspect.getdoc(obj)
    except Exception:
        return None


def _signature(obj: Any, name: str) -> str | None:
    """`name(params)`, one parameter a line when that is long, as IPython renders it."""
    try:
        signature = inspect.signature(obj)
    except Exception:  # builtins without a text signature, objects that aren't callable
        return None
    params: list[str] = []
    positional_only = False
    keyword_only_marked = False
    for param in signature.parameters.values():
        if param.kind == inspect.Parameter.POSITIONAL_ONLY:
            positional_only = True
        elif positional_only:
            params.append("/")
            positional_only = False
        if param.kind == inspect.Parameter.VAR_POSITIONAL:
            keyword_only_marked = True
        elif param.kind == inspect.Parameter.KEYWORD_ONLY and not keyword_only_marked:
            params.append("*")
            keyword_only_marked = True
        params.append(str(param))
    if positional_only:
        params.append("/")
    if len(name) + sum(len(param) + 2 for param in params) > _SIGNATURE_WIDTH:
        rendered = f"{name}(\n" + "".join(f"    {param},\n" for param in params) + ")"
    else:
        rendered = f"{name}({', '.join(params)})"
    if signature.return_annotation is not inspect.Signature.empty:
        rendered += f" -> {inspect.formatannotation(signature.return_annotation)}"
    return rendered


def _source(obj: Any) -> str | None:
    try:
        return inspect.getsource(obj).rstrip()
    except Exception:
        return None


def _has_docstring(source: str, docstring: str) -> bool:
    """Whether the source's own docstring is the docstring (then `??` shows it once)."""
    try:
        tree = ast.parse(inspect.cleandoc("\n" + source))
    except SyntaxError:
        return False
    for node in tree.body[:1]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return ast.get_docstring(node) == docstring
    return False


def _file(obj: Any) -> str | None:
    try:
        path = inspect.getsourcefile(obj) or inspect.getfile(obj)
    except Exception:
        return None
    if path.endswith((".so", ".pyd")):
        return None
    home = os.path.expanduser("~")
    if home not in ("~", "/") and path.startswith(home + os.sep):
        path = "~" + path[len(home) :]
    return path


def _string_form(obj: Any, detail_level: int) -> str | None:
    try:
        text = str(obj)
    except Exception:
        return None
    if not detail_level and len(text) > _STRING_MAX:
        half = (_STRING_MAX - 5) // 2
        text = text[:half] + " <...> " + text[-half:]
        text = ("\n" + " " * len("string_form")).join(part.strip() for part in text.split("\n"))
    return text


def _length(obj: Any) -> str | None:
    try:
        return str(len(obj))
    except Exception:
        return None


def _subclasses(cls: type) -> str | None:
    try:
        subclasses: list[type] = type.__subclasses__(cls)
        names = [sub.__name__ for sub in subclasses]
    except Exception:
        return None
    if len(names) >= 10:
        names = [*names[:10], "..."]
    return ", ".join(names) or None
