#!/usr/bin/env bash
# Builds cloche's container image: scripts/image.sh [--cluster] [TAG [DOCKER-BUILD-OPTION...]]
# (default TAG: cloche:latest; e.g. scripts/image.sh cloche:dev --no-cache for a cold build)
# --cluster adds the `cluster` extra (Ray) for cluster mode's pods (deploy/kubernetes/cluster/);
# its default TAG is cloche:cluster. CLOCHE_EXTRAS=a,b names pyproject.toml's extras directly.
# No image registry is needed: the Debian bookworm base image is made here from the
# machine's own Debian mirror with mmdebstrap, once, and reused by later builds.
# pip in the build trusts the machine's local CAs (/usr/local/share/ca-certificates).
# Environment: CLOCHE_BASE_IMAGE (default cloche-base:bookworm) names the base image; set it
# to e.g. debian:bookworm-slim where a registry is reachable. Needs a running Docker daemon.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

extras=${CLOCHE_EXTRAS:-}
default_tag=cloche:latest
if [ "${1:-}" = --cluster ]; then
    extras=${extras:+$extras,}cluster
    default_tag=cloche:cluster
    shift
fi
tag=${1:-$default_tag}
shift || true
base=${CLOCHE_BASE_IMAGE:-cloche-base:bookworm}
say() { printf '[image] %s\n' "$*" >&2; }

# One-line apt sources ("deb URI SUITE COMPONENTS") for every bookworm suite the machine's apt
# sources name, from both formats (deb822 *.sources and one-line *.list).
debian_mirror_lines() {
    local files=()
    [ -f /etc/apt/sources.list ] && files+=(/etc/apt/sources.list)
    for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && files+=("$f")
    done
    [ "${#files[@]}" -gt 0 ] || return 0
    awk '
        function flush(   n, i, s) {
            if (types ~ /(^| )deb( |$)/ && uri != "") {
                n = split(suites, s, / +/)
                for (i = 1; i <= n; i++) if (s[i] ~ /^bookworm(-[a-z]+)?$/) print "deb " uri " " s[i] " " comps
            }
            types = ""; uri = ""; suites = ""; comps = ""
        }
        FILENAME ~ /\.sources$/ {
            if ($0 ~ /^[ \t]*$/) { flush(); next }
            if ($1 == "Types:") { $1 = ""; types = substr($0, 2) }
            if ($1 == "URIs:") uri = $2
            if ($1 == "Suites:") { $1 = ""; suites = substr($0, 2) }
            if ($1 == "Components:") { $1 = ""; comps = substr($0, 2) }
            next
        }
        FNR == 1 { flush() }
        /^deb / && $3 ~ /^bookworm(-[a-z]+)?$/ { print }
        END { flush() }
    ' "${files[@]}" | sort -u
}

build_base() {
    if docker image inspect "$base" >/dev/null 2>&1; then
        return 0
    fi
    if [ "$base" != cloche-base:bookworm ]; then
        say "base image $base is missing: pull it, or unset CLOCHE_BASE_IMAGE to make one here"
        return 1
    fi
    if ! command -v mmdebstrap >/dev/null; then
        say "installing mmdebstrap"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
    fi
    local mirrors=()
    mapfile -t mirrors < <(debian_mirror_lines)
    if [ "${#mirrors[@]}" = 0 ]; then
        say "no Debian bookworm mirror in the machine's apt sources; using deb.debian.org"
        mirrors=("deb http://deb.debian.org/debian bookworm main")
    fi
    say "making the base image $base with mmdebstrap from:"
    printf '  %s\n' "${mirrors[@]}" >&2
    mmdebstrap --quiet --variant=minbase bookworm - "${mirrors[@]}" | docker import - "$base" >/dev/null
}

# The machine's local CAs (Debian's place for them), for pip inside the build when a proxy
# re-signs TLS; nothing of them reaches the final image.
local_cas() {
    local crt
    for crt in /usr/local/share/ca-certificates/*.crt; do
        [ -f "$crt" ] && cat "$crt"
    done
    return 0
}

build_base
say "building $tag${extras:+ with the extras $extras}"
docker build --build-arg "BASE=$base" --build-arg "EXTRA_CA_CERTS=$(local_cas)" \
    --build-arg "CLOCHE_EXTRAS=$extras" --tag "$tag" "$@" .
