#!/usr/bin/env bash
# Installs what cloche needs on a Debian/Ubuntu machine, idempotently:
#   runsc (gVisor), skopeo and umoci (templates from images), a virtualenv .venv with cloche,
#   the sandbox runtime .runtime/.
# Usage: scripts/install.sh [--dev] [--cluster]
#   --dev adds ruff, mypy, pytest, Playwright with Debian's chromium, mmdebstrap, ...;
#   --cluster adds Ray (cloche[cluster], for --cluster)
# Each step is skipped when already done, so a second run takes about a second.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dev=0
cluster=0
for arg in "$@"; do
    case "$arg" in
        --dev) dev=1 ;;
        --cluster) cluster=1 ;;
        *) echo "usage: scripts/install.sh [--dev] [--cluster]" >&2; exit 2 ;;
    esac
done
say() { printf '[install] %s\n' "$*" >&2; }

# The oldest runsc we accept without trying to upgrade: the first with systrap and
# the fix for CVE-2023-7258 that Debian ships (bookworm-backports).
MIN_RUNSC_DATE=20240729

# The build date (YYYYMMDD) in `runsc --version`'s first line, read on stdin: Debian's
# "runsc version 0.0~20240729.0" and gVisor's own "runsc version release-20240729.0".
parse_runsc_date() {
    awk '/^runsc version /{n = split($3, part, /[^0-9]+/)
        for (i = 1; i <= n; i++) if (length(part[i]) == 8) { print part[i]; exit } }'
}

runsc_date() {
    runsc --version 2>/dev/null | parse_runsc_date
}

apt_updated=0
apt_install() {
    if [ "$apt_updated" = 0 ]; then
        apt-get update -qq
        apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Debian bookworm's own runsc is old (ptrace only, no CVE-2023-7258 fix); its backports
# suite has a newer static build. Enable backports by deriving it from the configured source.
enable_bookworm_backports() {
    local src=/etc/apt/sources.list.d/debian.sources
    if [ -f "$src" ] && grep -q '^Suites:.*\bbookworm\b' "$src"; then
        if ! grep -q 'bookworm-backports' "$src"; then
            say "adding bookworm-backports to $src"
            sed -i '0,/^Suites:\(.*\bbookworm\b.*\)$/s//Suites:\1 bookworm-backports/' "$src"
            apt_updated=0
        fi
        return 0
    fi
    if [ -f /etc/apt/sources.list ] && grep -qE '^deb .* bookworm( |$)' /etc/apt/sources.list; then
        if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
            local mirror
            mirror=$(grep -E '^deb .* bookworm( |$)' /etc/apt/sources.list | head -n1 | awk '{print $2}')
            say "adding bookworm-backports from $mirror"
            echo "deb $mirror bookworm-backports main" >/etc/apt/sources.list.d/cloche-backports.list
            apt_updated=0
        fi
        return 0
    fi
    return 1
}

install_runsc() {
    local have
    have=$(runsc_date || true)
    if [ -n "$have" ] && [ "$have" -ge "$MIN_RUNSC_DATE" ]; then
        return 0
    fi
    if ! command -v apt-get >/dev/null; then
        say "runsc is missing and this is not a Debian/Ubuntu machine: install runsc from gVisor's"
        say "release channel (https://gvisor.dev/docs/user_guide/install/) or run with --backend unsafe-local"
        return 1
    fi
    if [ "$(id -u)" != 0 ]; then
        say "installing runsc needs root: run this script as root, or install runsc yourself"
        return 1
    fi
    if enable_bookworm_backports; then
        say "installing runsc from bookworm-backports"
        apt_install -t bookworm-backports runsc
    else
        say "installing runsc from the distribution"
        apt_install runsc
    fi
    have=$(runsc_date || true)
    say "runsc ${have:-?} installed"
    if [ -z "$have" ]; then
        say "warning: can't read the date in \`runsc --version\`: $(runsc --version 2>&1 | head -n1)"
    elif [ "$have" -lt "$MIN_RUNSC_DATE" ]; then
        say "warning: runsc $have is older than $MIN_RUNSC_DATE (no systrap, no CVE-2023-7258 fix)"
    fi
}

pick_python() {
    local py
    for py in "${CLOCHE_PYTHON:-}" python3.13 python3.12 python3.11 python3; do
        [ -n "$py" ] || continue
        if command -v "$py" >/dev/null &&
            "$py" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$py"
            return 0
        fi
    done
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt_install python3 python3-venv python3-dev
        command -v python3
        return 0
    fi
    say "cloche needs Python >= 3.11 with venv"
    return 1
}

# stamp NAME CONTENT...: true when NAME's stamp already records this content's hash.
stamp_ok() {
    local name=$1; shift
    [ -f "$name" ] && [ "$(cat "$name")" = "$(cat "$@" | sha256sum | cut -c1-16)" ]
}
stamp_write() {
    local name=$1; shift
    cat "$@" | sha256sum | cut -c1-16 >"$name"
}

install_venv() {
    local py=$1 extras="" wanted=()
    [ "$dev" = 1 ] && wanted+=(dev)
    [ "$cluster" = 1 ] && wanted+=(cluster)
    [ ${#wanted[@]} -gt 0 ] && extras="[$(IFS=,; echo "${wanted[*]}")]"
    if [ ! -x .venv/bin/python ]; then
        say "creating .venv with $py"
        "$py" -m venv .venv
    fi
    local stamp=.venv/.cloche-installed$extras
    if ! stamp_ok "$stamp" pyproject.toml; then
        say "installing cloche$extras into .venv"
        .venv/bin/python -m pip install -q --upgrade pip
        .venv/bin/python -m pip install -q -e ".$extras"
        stamp_write "$stamp" pyproject.toml
    fi
}

# The sandbox runtime: packages importable by code inside the sandbox, for the same
# interpreter that runs the server (its prefix is mounted read-only into each sandbox).
install_runtime() {
    if ! stamp_ok .runtime/.installed runtime-requirements.txt; then
        say "installing the sandbox runtime into .runtime/ (numpy, pandas, matplotlib, ...)"
        rm -rf .runtime
        .venv/bin/python -m pip install -q --target .runtime/site-packages -r runtime-requirements.txt
        stamp_write .runtime/.installed runtime-requirements.txt
    fi
    # matplotlib's font list, built once as sandboxes see fonts (cloche.sandbox.fonts), so
    # a session's first plot does not scan every font; again when a font directory changed.
    local fonts=.runtime/site-packages/.cloche/matplotlib
    if [ -d .runtime/site-packages/matplotlib ] && {
        ! compgen -G "$fonts/fontlist-*.json" >/dev/null ||
            [ -n "$(find /usr/share/fonts /usr/local/share/fonts -newer "$fonts" -print -quit 2>/dev/null)" ]
    }; then
        say "building matplotlib's font list for the sandboxes"
        .venv/bin/python -m cloche.sandbox.fonts .runtime/site-packages >/dev/null
    fi
}

# The container image's tests (tests/deploy, marker docker) need a Docker engine; they start
# dockerd themselves when none runs. Debian's docker.io is the engine they were measured with.
# With AppArmor on in the kernel (Debian's default), dockerd loads its profile into every
# container with apparmor_parser, which docker.io only recommends: without it no container
# starts, `docker build`'s RUN steps included ("exec: apparmor_parser: executable file not
# found"). So apparmor comes with docker.io, and later where AppArmor is on and it is missing.
install_docker() {
    if command -v dockerd >/dev/null; then
        if [ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null)" = Y ] &&
            ! command -v apparmor_parser >/dev/null && ! [ -x /sbin/apparmor_parser ] &&
            command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            say "installing apparmor (AppArmor is on: dockerd needs apparmor_parser)"
            apt_install --no-install-recommends apparmor
        fi
        return 0
    fi
    if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
        say "no dockerd here: the docker tests need a Docker engine (or deselect: -m 'not docker')"
        return 0
    fi
    say "installing docker.io and apparmor (for the container image tests)"
    apt_install --no-install-recommends docker.io apparmor
}

# The inspector's browser tests (tests/server/test_ui.py) drive Debian's chromium through
# Playwright, which is not allowed to download a browser of its own.
install_chromium() {
    command -v chromium >/dev/null && return 0
    if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
        say "no chromium here: the inspector's browser tests need it (apt-get install chromium)"
        return 0
    fi
    say "installing chromium (for the inspector's browser tests)"
    apt_install --no-install-recommends chromium
}

# Templates from images: skopeo copies an image into an OCI layout, umoci applies its
# layers. The template tests make their root filesystem tarballs with mmdebstrap (--dev).
install_image_tools() {
    local wanted=() tool
    for tool in skopeo umoci; do
        command -v "$tool" >/dev/null || wanted+=("$tool")
    done
    if [ "$dev" = 1 ] && ! command -v mmdebstrap >/dev/null; then
        wanted+=(mmdebstrap)
    fi
    [ ${#wanted[@]} -gt 0 ] || return 0
    if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
        say "missing ${wanted[*]}: building templates from images needs skopeo and umoci"
        return 0
    fi
    say "installing ${wanted[*]} (templates from images)"
    apt_install --no-install-recommends "${wanted[@]}"
}

main() {
    install_runsc || say "continuing without runsc: only --backend unsafe-local will work"
    install_image_tools
    [ "$dev" = 1 ] && install_docker
    [ "$dev" = 1 ] && install_chromium
    local py
    py=$(pick_python)
    install_venv "$py"
    install_runtime
}

# Sourced (by the tests, to call one function), it only defines the functions.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main
fi
