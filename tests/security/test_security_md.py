"""SECURITY.md lists exactly the attacks of this suite and the server's real defaults."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def load_generator():
    path = ROOT / "scripts" / "security_table.py"
    spec = importlib.util.spec_from_file_location("security_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_security_md_matches_the_suite_and_the_defaults():
    generator = load_generator()
    document = (ROOT / "SECURITY.md").read_text()
    assert generator.splice(document, generator.render()) == document, (
        "SECURITY.md is out of date: run .venv/bin/python scripts/security_table.py --write"
    )


def test_every_attack_in_the_suite_is_in_the_table():
    generator = load_generator()
    document = (ROOT / "SECURITY.md").read_text()
    names = [name for _, name, _, _ in generator.attack_rows()]
    assert len(names) >= 30
    assert all(f"`{name}`" in document for name in names)
