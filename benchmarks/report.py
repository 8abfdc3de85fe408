"""Tables, verdicts and plots from a suite run's results.json.

    .venv/bin/python benchmarks/report.py benchmarks/results/results.json

(`suite.py` calls this at the end of a run; running it alone re-renders without measuring.)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  # the backend is chosen first

Results = dict[str, Any]


def pct(samples: list[float], percent: int) -> float:
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[percent - 1]


def fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def stats_row(name: str, unit: str, samples: list[float]) -> list[str]:
    if not samples:
        return [name, unit, "0", "-", "-", "-", "-"]
    many = len(samples) >= 20
    return [
        name,
        unit,
        str(len(samples)),
        fmt(pct(samples, 50)),
        fmt(pct(samples, 90)) if len(samples) >= 10 else "-",
        fmt(pct(samples, 99)) if many else "-",
        fmt(max(samples)),
    ]


def verdict(ok: bool, miss: str) -> str:
    return "met" if ok else f"MISSED: {miss}"


def targets(r: Results) -> list[list[str]]:
    lat, ms, mem = r["latency_us"], r["samples_ms"], r["memory"]
    floor, tcp, http, jup = (pct(lat[k], 50) for k in ("floor", "tcp", "http", "jupyter"))
    rows = [["target", "measured", "verdict"]]
    ratio = tcp / floor
    rows.append(
        [
            "warm TCP cell p50 ≤ 1.5× the runsc pipe floor",
            f"{ratio:.1f}× ({tcp:.0f} / {floor:.0f} µs)",
            verdict(ratio <= 1.5, f"{ratio / 1.5:.1f}× too slow ({tcp - 1.5 * floor:.0f} µs over)"),
        ]
    )
    speedup = jup / tcp
    rows.append(
        [
            "warm TCP cell ≥ 10× faster than unsandboxed Jupyter",
            f"{speedup:.1f}× ({jup:.0f} / {tcp:.0f} µs)",
            verdict(speedup >= 10, f"{10 / speedup:.1f}× short"),
        ]
    )
    rows.append(
        [
            "warm HTTP cell p50 ≤ 2 ms",
            f"{http / 1000:.2f} ms",
            verdict(http <= 2000, f"{http / 1000 - 2:.2f} ms over"),
        ]
    )
    for profile in ("lean", "data"):
        for key, what in (
            ("create_only", "`POST /v1/sessions`"),
            ("new_session_tcp", "with its first cell, one TCP request"),
            ("new_session", "with its first cell, two HTTP requests"),
        ):
            samples = ms.get(f"{key}_{profile}")
            if not samples:
                continue
            p50 = pct(samples, 50)
            rows.append(
                [
                    f"new {profile} session from the pool p50 ≤ 5 ms: {what}",
                    f"{p50:.1f} ms",
                    verdict(p50 <= 5, f"{p50 - 5:.1f} ms over"),
                ]
            )
    imports = pct(ms["import_pandas_data_kernel"], 50)
    rows.append(
        [
            "`import pandas` in a data session < 1 ms (the cell's own time)",
            f"{imports:.3f} ms (round trip over HTTP {pct(ms['import_pandas_data'], 50):.2f} ms)",
            verdict(imports < 1, f"{imports - 1:.2f} ms over"),
        ]
    )
    terrarium = pct(ms["terrarium"], 50)
    rows.append(
        [
            "Terrarium-style one-shot request p50 ≤ 25 ms",
            f"{terrarium:.1f} ms",
            verdict(terrarium <= 25, f"{terrarium - 25:.1f} ms over"),
        ]
    )
    level = _level(r, 100)
    if level is not None:
        cloche, floor_tp = level
        if floor_tp is not None:
            share = cloche["throughput_per_s"] / floor_tp["throughput_per_s"]
            rows.append(
                [
                    f"{cloche['sessions']} sessions: cells/s ≥ 70% of the floor's echo",
                    f"{share:.0%} ({cloche['throughput_per_s']:,.0f} / "
                    f"{floor_tp['throughput_per_s']:,.0f})",
                    verdict(share >= 0.7, f"{0.7 - share:.0%} short"),
                ]
            )
        p99 = cloche.get("p99_ms", float("inf"))
        rows.append(
            [
                f"{cloche['sessions']} sessions: p99 ≤ 10 ms, zero errors",
                f"p99 {p99:.1f} ms, {cloche['errors']} errors",
                verdict(p99 <= 10 and cloche["errors"] == 0, f"p99 {p99 - 10:.1f} ms over"),
            ]
        )
    rows += _scaling_targets(r)
    lean = _inside(mem, "lean")
    if lean is not None:
        rows.append(
            [
                "idle lean session ≤ 25 MiB (the larger of its PSS and its memory cgroup)",
                f"{lean:.1f} MiB (MemAvailable drop "
                f"{mem['lean_available_drop_per_session_mib']:.1f} MiB)",
                verdict(lean <= 25, f"{lean - 25:.1f} MiB over"),
            ]
        )
    data, outside = _inside(mem, "data"), mem.get("data_outside_pss_mib")
    if data is not None and outside:
        rows.append(
            [
                "data session ≤ 1.3× the same imports outside a sandbox (PSS)",
                f"{data / outside:.2f}× ({data:.0f} / {outside:.0f} MiB)",
                verdict(data / outside <= 1.3, f"{data / outside - 1.3:.2f}× over"),
            ]
        )
    if "idle_created" in mem:
        held = mem["idle_created"]
        rows.append(
            [
                f"{mem.get('idle_wanted', held)} idle lean sessions held, server answering",
                f"{held} held, MemAvailable −{mem['idle_available_drop_gib']:.1f} GiB, "
                f"probe p50 {mem['idle_probe_p50_ms']:.2f} ms, {mem['idle_probe_errors']} errors",
                verdict(
                    mem["idle_create_failures"] == 0 and mem["idle_probe_errors"] == 0,
                    f"{mem['idle_create_failures']} creations failed",
                ),
            ]
        )
    return rows


def _inside(mem: dict[str, Any], profile: str) -> float | None:
    """A session's memory inside gVisor: PSS misses pages of gVisor's memory file that no
    process maps, the cgroup counts them; the larger of the two, to be safe."""
    found = [
        mem.get(f"{profile}_pss_per_session_mib"),
        mem.get(f"{profile}_cgroup_per_session_mib"),
    ]
    values = [v for v in found if v is not None]
    return max(values) if values else None


def _scaling_targets(r: Results) -> list[list[str]]:
    """Issue 13's: cells/s at 50 and 100 busy sessions, 100 against 10, p99 at 100."""
    cloche = {t["sessions"]: t for t in r["throughput"] if t["system"] == "cloche"}
    rows = []
    for sessions, wanted in ((50, 1000), (100, 850)):
        if sessions in cloche:
            got = cloche[sessions]["throughput_per_s"]
            rows.append(
                [
                    f"{sessions} busy sessions: ≥ {wanted:,} cells/s, zero errors",
                    f"{got:,.0f} cells/s, {cloche[sessions]['errors']} errors",
                    verdict(
                        got >= wanted and cloche[sessions]["errors"] == 0,
                        f"{wanted - got:,.0f} cells/s short",
                    ),
                ]
            )
    if 10 in cloche and 100 in cloche:
        share = cloche[100]["throughput_per_s"] / cloche[10]["throughput_per_s"]
        rows.append(
            [
                "100 busy sessions: cells/s ≥ 80% of 10 sessions'",
                f"{share:.0%}",
                verdict(share >= 0.8, f"{0.8 - share:.0%} short"),
            ]
        )
        p99 = cloche[100].get("p99_ms", float("inf"))
        rows.append(
            [
                "100 busy sessions: p99 ≤ 250 ms",
                f"{p99:.0f} ms",
                verdict(p99 <= 250, f"{p99 - 250:.0f} ms over"),
            ]
        )
    return rows


def _level(r: Results, sessions: int) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """(cloche, the floor or None if it wasn't measured) at the level nearest `sessions`."""
    rows = {(t["system"], t["sessions"]): t for t in r["throughput"]}
    if ("cloche", sessions) not in rows:
        available = sorted(s for (system, s) in rows if system == "cloche")
        if not available:
            return None
        sessions = min(available, key=lambda s: abs(s - sessions))
    return rows[("cloche", sessions)], rows.get(("floor", sessions))


def render_markdown(r: Results) -> str:
    lat, ms = r["latency_us"], r["samples_ms"]
    facts = r["facts"]
    floor50 = pct(lat["floor"], 50)
    out = ["## Targets", "", table(targets(r)), ""]
    out += ["## Single client: round trip of `1+1` (µs)", ""]
    rows = [["what", "unit", "n", "p50", "p90", "p99", "max", "× floor p50"]]
    names = {
        "floor": "floor: 47 B echoed through a runsc sandbox's pipes",
        "tcp": "cloche, TCP protocol",
        "http": "cloche, HTTP sessions API",
        "jupyter": "Jupyter (ipykernel, no sandbox) via jupyter_client",
    }
    for key, name in names.items():
        rows.append([*stats_row(name, "µs", lat[key]), f"{pct(lat[key], 50) / floor50:.1f}×"])
    out += [table(rows), ""]
    out += ["## Starting things (ms)", ""]
    rows = [["what", "unit", "n", "p50", "p90", "p99", "max"]]
    starts = {
        "cold_runsc": "floor: cold `runsc run` of `python3 -S -c pass`",
        "sandbox_per_cell": "one sandbox per cell: `runsc run python3 -c 'print(1+1)'`",
        "create_only_lean": "cloche: new lean session from the pool, `POST /v1/sessions` alone",
        "new_session_lean": "cloche: new lean session from the pool + first cell (HTTP)",
        "new_session_tcp_lean": "cloche: new lean session + first cell, one TCP request",
        "create_only_data": "cloche: new data session from the pool, `POST /v1/sessions` alone",
        "new_session_data": "cloche: new data session from the pool + first cell (HTTP)",
        "new_session_tcp_data": "cloche: new data session + first cell, one TCP request",
        "cell_after_pause": "cloche: a cell of an existing session after the same rest (HTTP)",
        "new_session_miss": "cloche: new lean session, no pool + first cell",
        "pool_start_lean_afresh": "cloche: a lean pool sandbox started (server log)",
        "pool_start_data_afresh": "cloche: a data pool sandbox started afresh + imports",
        "pool_start_data_checkpoint": "cloche: checkpointing the data template",
        "pool_start_data_restored": "cloche: a data pool sandbox restored from the template",
        "terrarium": "cloche: Terrarium-style `POST /` (data pool)",
        "import_pandas_data": "cloche: `import pandas` in a data session, round trip (HTTP)",
        "import_pandas_data_kernel": "cloche: `import pandas` in a data session, the cell's time",
    }
    for key, name in starts.items():
        if key in ms:
            rows.append(stats_row(name, "ms", ms[key]))
    out += [table(rows), ""]
    out += ["## Throughput: `1+1` cells over TCP, one session per client", ""]
    rows = [
        [
            "sessions",
            "floor cells/s",
            "cloche cells/s",
            "cloche / floor",
            "floor p99 ms",
            "cloche p50 ms",
            "cloche p99 ms",
            "errors",
        ]
    ]
    levels = sorted({t["sessions"] for t in r["throughput"]})
    for level in levels:
        pair = _level(r, level)
        assert pair is not None
        cloche, floor = pair
        rows.append(
            [
                str(level),
                f"{floor['throughput_per_s']:,.0f}" if floor else "-",
                f"{cloche['throughput_per_s']:,.0f}",
                f"{cloche['throughput_per_s'] / floor['throughput_per_s']:.0%}" if floor else "-",
                f"{floor.get('p99_ms', 0):.2f}" if floor else "-",
                f"{cloche.get('p50_ms', 0):.2f}",
                f"{cloche.get('p99_ms', 0):.2f}",
                str(cloche["errors"] + (floor["errors"] if floor else 0)),
            ]
        )
    out += [table(rows), ""]
    mem = r["memory"]
    out += ["## Memory", ""]
    rows = [["what", "MiB (or as said)"]]
    for key, name in (
        ("lean_pss_per_session_mib", "idle lean session: PSS of its runsc processes"),
        ("lean_available_drop_per_session_mib", "idle lean session: drop of MemAvailable"),
        ("lean_cgroup_per_session_mib", "idle lean session: its sandbox's memory cgroup"),
        ("lean_outside_pss_mib", "plain `python3 -I -S` outside a sandbox (PSS)"),
        ("data_pss_per_session_mib", "idle data session: PSS of its runsc processes"),
        ("data_available_drop_per_session_mib", "idle data session: drop of MemAvailable"),
        ("data_cgroup_per_session_mib", "idle data session: its sandbox's memory cgroup"),
        ("data_outside_pss_mib", "python3 with the data imports, outside a sandbox (PSS)"),
    ):
        if key in mem:
            rows.append([name, f"{mem[key]:.1f}"])
    if "idle_cpu_per_session_pct" in mem:
        rows.append(
            [
                f"CPU of an idle sandbox (% of one core; {mem['idle_cpu_sessions']} sessions idle)",
                f"{mem['idle_cpu_per_session_pct']:.2f}",
            ]
        )
    out += [table(rows), ""]
    out += [
        f"Machine: {facts['cpus']} CPUs, {facts['mem_total_gib']} GiB, kernel {facts['kernel']}, "
        f"Python {facts['python']}, {facts['runsc']}; load average {facts['load_before']:.2f} "
        f"before the run; {facts['date']}.",
        "",
    ]
    return "\n".join(out)


def plot(r: Results, out: Path) -> list[Path]:
    made = []
    lat = r["latency_us"]
    figure, axes = plt.subplots(figsize=(7, 4))
    for key, label in (
        ("floor", "runsc pipe floor"),
        ("tcp", "cloche TCP"),
        ("http", "cloche HTTP"),
        ("jupyter", "Jupyter (no sandbox)"),
    ):
        samples = sorted(lat[key])
        axes.plot(
            [s / 1000 for s in samples],
            [i / len(samples) for i in range(len(samples))],
            label=label,
        )
    axes.set_xscale("log")
    axes.set_xlabel("round trip of `1+1` (ms, log scale)")
    axes.set_ylabel("fraction of cells")
    axes.set_title("Latency CDF, one client")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    made.append(_save(figure, out / "latency_cdf.png"))

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for system, label in (("floor", "runsc pipe floor"), ("cloche", "cloche TCP")):
        points = sorted((t["sessions"], t) for t in r["throughput"] if t["system"] == system)
        left.plot(
            [s for s, _ in points], [t["throughput_per_s"] for _, t in points], "o-", label=label
        )
        right.plot(
            [s for s, _ in points], [t.get("p99_ms", 0) for _, t in points], "o-", label=label
        )
    left.set_xlabel("concurrent sessions")
    left.set_ylabel("cells / s")
    left.set_title("Throughput")
    right.set_xlabel("concurrent sessions")
    right.set_ylabel("p99 (ms)")
    right.set_title("p99 latency")
    for axes in (left, right):
        axes.grid(True, alpha=0.3)
        axes.legend()
    made.append(_save(figure, out / "throughput.png"))

    series = r["memory"].get("series")
    if series:
        figure, axes = plt.subplots(figsize=(7, 4))
        axes.plot(
            [p["sessions"] for p in series],
            [p["pss_mib"] / 1024 for p in series],
            "o-",
            label="PSS of the sandboxes",
        )
        axes.plot(
            [p["sessions"] for p in series],
            [p["available_drop_mib"] / 1024 for p in series],
            "s-",
            label="drop of MemAvailable",
        )
        axes.set_xlabel("idle lean sessions")
        axes.set_ylabel("GiB")
        axes.set_title("Memory vs idle sessions")
        axes.grid(True, alpha=0.3)
        axes.legend()
        made.append(_save(figure, out / "memory.png"))
    return made


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_report(r: Results, out: Path) -> None:
    (out / "results.md").write_text(render_markdown(r))
    plot(r, out)


if __name__ == "__main__":
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/results.json")
    write_report(json.loads(source.read_text()), source.parent)
    print((source.parent / "results.md").read_text())
