#!/usr/bin/env bash
# Install what is missing plus the dev tools, then run every check: ruff, mypy, pytest.
# Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh --dev --cluster
echo "== ruff" && .venv/bin/ruff check src tests benchmarks
echo "== ruff format" && .venv/bin/ruff format --check src tests benchmarks
echo "== mypy" && .venv/bin/mypy
echo "== pytest" && exec .venv/bin/pytest "$@"
