#!/usr/bin/env python3
"""Render SECURITY.md's generated sections from the security suite and the default limits.

    .venv/bin/python scripts/security_table.py          # print the sections
    .venv/bin/python scripts/security_table.py --write  # rewrite them in SECURITY.md

Each test in tests/security/ has a docstring "<attack>. Outcome: <what happens>"; the table
lists them in file order. tests/security/test_security_md.py fails when SECURITY.md and the
suite disagree, so the document can't drift from what is tested.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "tests" / "security"
DOCUMENT = ROOT / "SECURITY.md"
SECTIONS = ("attacks", "limits")


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def attack_rows() -> list[tuple[str, str, str, str]]:
    """(module title, test name, attack, outcome) for every test in the suite."""
    rows = []
    for path in sorted(SUITE.glob("test_*.py")):
        module = ast.parse(path.read_text())
        title = _one_line((ast.get_docstring(module) or path.stem).split(".")[0])
        for node in module.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                doc = ast.get_docstring(node) or ""
                if "Outcome:" not in doc:
                    if path.name == "test_security_md.py":
                        continue
                    raise SystemExit(f"{path.name}::{node.name} has no 'Outcome:' in its docstring")
                attack, outcome = doc.split("Outcome:", 1)
                rows.append((title, node.name, _one_line(attack), _one_line(outcome)))
    return rows


def attacks_section() -> str:
    lines = ["| attack | outcome | test |", "|---|---|---|"]
    current = None
    for title, name, attack, outcome in attack_rows():
        if title != current:
            lines.append(f"| **{title}** | | |")
            current = title
        lines.append(f"| {attack} | {outcome} | `{name}` |")
    return "\n".join(lines)


def limits_section() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    from cloche.commands.settings import SERVE_OPTIONS

    wanted = (
        "--cell-timeout",
        "--interrupt-grace",
        "--memory-mib",
        "--nproc",
        "--nofile",
        "--disk-mib",
        "--output-limit",
        "--idle-timeout",
        "--lifetime",
        "--cpu-quota",
        "--max-sessions",
        "--max-queued-cells",
        "--max-frame-bytes",
        "--max-connections",
        "--connection-timeout",
    )
    by_flag = {option.flag: option for option in SERVE_OPTIONS}
    lines = ["| setting | default | what |", "|---|---|---|"]
    for flag in wanted:
        option = by_flag[flag]
        default = (
            "unlimited"
            if option.default is None
            else f"{option.default:g}"
            if isinstance(option.default, float)
            else str(option.default)
        )
        lines.append(f"| `{flag}` | {default} | {_one_line(option.help)} |")
    return "\n".join(lines)


def render() -> dict[str, str]:
    return {"attacks": attacks_section(), "limits": limits_section()}


def splice(document: str, sections: dict[str, str]) -> str:
    for name, body in sections.items():
        pattern = re.compile(rf"(<!-- {name}:begin[^>]*-->\n).*?(<!-- {name}:end -->)", re.DOTALL)
        if not pattern.search(document):
            raise SystemExit(f"SECURITY.md has no <!-- {name}:begin --> ... <!-- {name}:end -->")
        document = pattern.sub(lambda m, body=body: m[1] + body + "\n" + m[2], document)
    return document


def main() -> None:
    sections = render()
    if "--write" in sys.argv:
        DOCUMENT.write_text(splice(DOCUMENT.read_text(), sections))
    else:
        for name in SECTIONS:
            print(f"<!-- {name} -->\n{sections[name]}\n")


if __name__ == "__main__":
    main()
