#!/usr/bin/env bash
# Install what is missing (runsc, .venv, the sandbox runtime), then run the server in the
# foreground. Arguments are passed to `cloche serve` (see `cloche serve --help`); with
# `--cluster local:N` it starts an N-node Ray cluster on this machine and removes it on SIGTERM.
set -euo pipefail
cd "$(dirname "$0")"
# --cluster (local:N, auto, HOST:PORT, ray://...) needs Ray: installed only then.
install=()
for arg in "$@"; do
    case "$arg" in --cluster|--cluster=*) install=(--cluster) ;; esac
done
scripts/install.sh "${install[@]}"
exec .venv/bin/cloche serve "$@"
