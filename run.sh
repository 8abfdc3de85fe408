#!/usr/bin/env bash
# Install what is missing (runsc, .venv, the sandbox runtime), then run the server in the
# foreground. Arguments are passed to `cloche serve` (see `cloche serve --help`).
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh
exec .venv/bin/cloche serve "$@"
