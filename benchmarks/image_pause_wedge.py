"""How often a session wedges at its first command after a pause and resume, for a template
built from an image against the built-in `python` template, in one run of one test server.
Sandboxes started on ptrace (`--platform auto` beyond 2 per core) and restored on systrap
wedged about half the time until images were restored on the platform that made them.

    sudo .venv/bin/python benchmarks/image_pause_wedge.py [--rounds 20] [--platform systrap]
        [--pool-size 2] [--ptrace-from 0]

--ptrace-from N (with --platform auto): start on ptrace the sandboxes started while N per
core already run, instead of 2 (0: all of them but a pool's template).

Each round: a new session, a command as root changing its system, pause, then a command
as root that must answer within its 15 s timeout. Outcomes counted per template: `ok`,
`supervisor` (its start was not answered), `timeout` (it started and never told its end),
or the error's first words. The image is Debian bookworm minbase without python3 (mmdebstrap,
as the tests make it); a wedged round costs ~30-75 s.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import httpx

from cloche.sandbox import gvisor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from images_support import make_debian_tar  # noqa: E402
from support import ServerThread, make_config  # noqa: E402

# What the security test does as root before its pause: a write copied up into the layer,
# a binary replaced and one removed (a whiteout), a setuid bit, links.
FIRST = (
    "echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd && cp /usr/bin/true /usr/bin/id "
    "&& chmod 4755 /usr/bin/env && rm /usr/bin/su && ln -s /etc/shadow /home/user/shadow-link "
    "&& ln -s /etc/shadow /usr/local/share/shadow-link && ln -s / /root/host-root"
)
AFTER = "tail -1 /etc/passwd; id -u"
EXPECTED = "evil:x:0:0::/:/bin/sh\n"  # `id` is `true` now: it prints nothing


def outcome(http: httpx.Client, session: str) -> str:
    body = {"cmd": AFTER, "user": "root", "timeout": 15}
    try:
        done = http.post(f"/v1/sessions/{session}/commands", json=body, timeout=180)
    except httpx.TimeoutException:
        return "hang"
    if done.status_code != 200:
        message = str(done.json().get("error", {}).get("message", done.text))
        return "supervisor" if "did not answer" in message else " ".join(message.split()[:5])
    result = done.json()
    if result["end_reason"] == "ok" and result["stdout"] == EXPECTED:
        return "ok"
    return str(result["end_reason"])


def rounds_of(http: httpx.Client, template: str, rounds: int) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(rounds):
        made = http.post("/v1/sessions", json={"template": template})
        made.raise_for_status()
        session = made.json()["id"]
        first = http.post(
            f"/v1/sessions/{session}/commands", json={"cmd": FIRST, "user": "root"}
        ).json()
        assert first["exit_code"] == 0, first
        assert http.post(f"/v1/sessions/{session}/pause").status_code == 200
        seen[outcome(http, session)] += 1
        http.delete(f"/v1/sessions/{session}", timeout=120)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--platform", default="systrap", help="auto, systrap or ptrace")
    parser.add_argument("--pool-size", type=int, default=2, help="warm sandboxes per template")
    parser.add_argument("--ptrace-from", type=int, help="sandboxes per core before ptrace")
    args = parser.parse_args()
    if args.ptrace_from is not None:
        gvisor.PTRACE_FROM_PER_CORE = args.ptrace_from
    with tempfile.TemporaryDirectory(prefix="cloche-wedge-", dir="/var/tmp") as scratch:
        root = Path(scratch)
        tar = make_debian_tar(root / "bookworm.tar", python=False)
        config = make_config(root / "state", pool_size=args.pool_size, platform=args.platform)
        with ServerThread(config) as server:
            base = f"http://127.0.0.1:{server.http_port}"
            with httpx.Client(base_url=base, timeout=300) as http:
                started = http.post("/v1/templates", json={"name": "image", "from_tar": str(tar)})
                assert started.status_code == 202, started.text
                while http.get("/v1/templates/image").json()["state"] == "building":
                    time.sleep(0.2)  # polling a build
                print(
                    f"platform {args.platform}, ptrace from {gvisor.PTRACE_FROM_PER_CORE} per "
                    f"core, pool {args.pool_size}, {args.rounds} rounds each"
                )
                for template in ("image", "python"):
                    seen = rounds_of(http, template, args.rounds)
                    wedged = args.rounds - seen["ok"]
                    print(f"{template:7} wedged {wedged}/{args.rounds}  {dict(seen)}", flush=True)


if __name__ == "__main__":
    main()
