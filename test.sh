#!/usr/bin/env bash
# Install what is missing plus the dev tools, then run every check: ruff, mypy, pytest.
# Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh --dev --cluster
echo "== ruff" && .venv/bin/ruff check src tests benchmarks
echo "== ruff format" && .venv/bin/ruff format --check src tests benchmarks
echo "== mypy" && .venv/bin/mypy
# pytest's temp dirs go in one base dir of this run alone, removed afterwards: the shared
# /tmp/pytest-of-$USER keeps earlier runs' dirs (sandboxes' files included), and pytest's own
# sweep of those at the end of a run has failed with an unclosed-scandir warning (an error).
basetemp=$(mktemp -d /tmp/cloche-pytest-XXXXXX)
trap 'rm -rf --one-file-system "$basetemp"' EXIT
echo "== pytest" && .venv/bin/pytest --basetemp="$basetemp" --durations=30 "$@"
