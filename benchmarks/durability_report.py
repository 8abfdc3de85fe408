"""The durability benchmark's figures: each sample set summed up, the verdicts against
issue 12's targets, and both as tables (text, or markdown).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from durability_parts import ANSWER_WORKERS, FORK_MANY, GIB, MIB, PageOutRun, ProfileRun, RestartRun


@dataclass(frozen=True)
class Summary:
    n: int
    p50: float
    p90: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: list[float]) -> Summary:
        if not samples:
            raise ValueError("no samples")
        if len(samples) == 1:
            return cls(1, samples[0], samples[0], samples[0], samples[0])
        p90 = statistics.quantiles(samples, n=10, method="inclusive")[8]
        return cls(len(samples), statistics.median(samples), p90, min(samples), max(samples))


def fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def verdict(measured: float, target: float, unit: str, at_least: bool = False) -> str:
    """met/MISSED with the ratio of measured to target."""
    if math.isnan(measured):
        return "NO SAMPLE: every attempt failed"
    ratio = measured / target
    ok = measured >= target if at_least else measured <= target
    if ok:
        return f"met ({ratio:.2f}x the target)"
    gap = target - measured if at_least else measured - target
    return f"MISSED: {ratio:.2f}x the target ({fmt(gap)} {unit} {'short' if at_least else 'over'})"


def verdicts(
    runs: list[ProfileRun], restarted: RestartRun | None, paged: PageOutRun | None, disk_free: int
) -> list[list[str]]:
    rows: list[list[str]] = []
    by = {run.profile: run for run in runs}

    def p50(profile: str, what: str) -> float:
        samples = by[profile].samples_ms.get(what)
        return Summary.of(samples).p50 if samples else math.nan

    if "lean" in by:
        for what, target in (("pause", 300.0), ("resume on first cell", 400.0)):
            got = p50("lean", what)
            rows.append(
                [f"lean {what} p50 <= {target:.0f} ms", f"{got:.0f} ms", verdict(got, target, "ms")]
            )
        first = p50("lean", "fork of 1: response")
        rows.append(
            ["lean fork, first copy p50 <= 500 ms", f"{first:.0f} ms", verdict(first, 500, "ms")]
        )
        many = p50("lean", f"fork of {FORK_MANY}: response")
        after = (FORK_MANY - 1) / max((many - first) / 1000, 1e-9)
        rows.append(
            [
                "lean fork, >= 5 copies/s after the first",
                f"{after:.1f}/s ({FORK_MANY - 1} more in {many - first:.0f} ms: fork of "
                f"{FORK_MANY} {many:.0f} ms - fork of 1 {first:.0f} ms)",
                verdict(after, 5.0, "copies/s", at_least=True),
            ]
        )
    if "data" in by:
        for what in ("pause", "resume on first cell"):
            got = p50("data", what)
            rows.append(
                [f"data {what} p50 <= 1.5 s", f"{got / 1000:.2f} s", verdict(got, 1500, "ms")]
            )
    if restarted is not None:
        n = restarted.sessions
        back = restarted.stop_s + restarted.all_answered_s
        listening = restarted.stop_s + restarted.listening_s
        rows.append(
            [
                f"restart with 100 live lean sessions back to serving <= 30 s (measured with {n})",
                f"{back:.1f} s SIGTERM -> all {n} answered ({listening:.1f} s to the new "
                "server listening)",
                verdict(back, 30.0, "s"),
            ]
        )
    if paged is not None:
        per_kib = paged.ram_per_session_kib
        disk_per = paged.disk_bytes / paged.sessions
        ram_2000 = 2000 * per_kib * 1024
        disk_2000 = 2000 * disk_per
        own = (paged.server_held_after_kib - paged.server_held_before_kib) / paged.sessions
        measured = (
            f"{paged.sessions} paused: {per_kib / 1024:.2f} MiB RAM each by MemAvailable "
            f"({own / 1024:.2f} MiB by the server's RSS and cgroups), {disk_per / MIB:.1f} MiB "
            f"disk each; 2000 would need {ram_2000 / GIB:.1f} GiB RAM, {disk_2000 / GIB:.1f} GiB "
            f"disk ({disk_free / GIB:.0f} GiB free)"
        )
        fits = ram_2000 <= 20 * GIB and disk_2000 <= disk_free
        how = "measured" if paged.sessions >= 2000 else f"projected from {paged.sessions}"
        rows.append(
            [
                "2000 sessions held on this 24 GiB machine with page-out",
                measured,
                f"{'met' if fits else 'MISSED'} ({how}; RAM {ram_2000 / (20 * GIB):.2f}x of 20 "
                f"GiB usable, disk {disk_2000 / max(disk_free, 1):.2f}x of free)",
            ]
        )
    return rows


def measurement_rows(
    runs: list[ProfileRun], restarted: RestartRun | None, paged: PageOutRun | None
) -> list[list[str]]:
    rows: list[list[str]] = []

    def add(what: str, unit: str, samples: list[float]) -> None:
        if not samples:
            rows.append([what, unit, "0", "-", "-", "-", "-"])
            return
        s = Summary.of(samples)
        p90 = fmt(s.p90) if s.n >= 5 else "-"
        rows.append([what, unit, str(s.n), fmt(s.p50), p90, fmt(s.min), fmt(s.max)])

    for run in runs:
        for what, samples in run.samples_ms.items():
            add(f"{run.profile}: {what}", "ms", samples)
        many = run.samples_ms.get(f"fork of {FORK_MANY}: response", [])
        if many:
            add(
                f"{run.profile}: fork of {FORK_MANY}: copies/s",
                "/s",
                [FORK_MANY * 1000 / ms for ms in many],
            )
        add(
            f"{run.profile}: snapshot size_bytes", "MiB", [b / MIB for b in run.snapshot_size_bytes]
        )
        add(f"{run.profile}: snapshot on disk", "MiB", [b / MIB for b in run.snapshot_disk_bytes])
        add(
            f"{run.profile}: paused session on disk",
            "MiB",
            [b / MIB for b in run.paused_disk_bytes],
        )
    if restarted is not None:
        n = restarted.sessions
        add(f"restart: making {n} sessions (4 at once)", "s", [restarted.create_s])
        add(f"restart: SIGTERM -> exit, pausing {n}", "s", [restarted.stop_s])
        add("restart: the server's own pause time per session", "ms", restarted.shutdown_pause_ms)
        add(
            "restart: a fresh server's start -> listening (for scale)",
            "s",
            [restarted.fresh_listening_s],
        )
        add("restart: new server start -> listening", "s", [restarted.listening_s])
        add(f"restart: new server start -> all {n} answered", "s", [restarted.all_answered_s])
        add(
            f"restart: first cell of each ({ANSWER_WORKERS} at once)", "ms", restarted.first_cell_ms
        )
        add(f"restart: second SIGTERM -> exit, pausing {n} again", "s", [restarted.second_stop_s])
    if paged is not None:
        m = paged.sessions
        add(f"page-out: making {m} sessions (4 at once)", "s", [paged.create_s])
        add(f"page-out: first made -> all {m} paused", "s", [paged.all_paused_s])
        drop = paged.mem_available_before_kib - paged.mem_available_after_kib
        add(f"page-out: MemAvailable drop with {m} paused", "MiB", [drop / 1024])
        add("page-out: MemAvailable drop per paused session", "MiB", [drop / 1024 / m])
        held = paged.server_held_after_kib - paged.server_held_before_kib
        add("page-out: RAM the server holds (RSS + sandbox cgroups), growth", "MiB", [held / 1024])
        add("page-out: ... per paused session", "MiB", [held / 1024 / m])
        add("page-out: disk per paused session", "MiB", [paged.disk_bytes / MIB / m])
        add(
            "page-out: cloche_data_dir_bytes per session",
            "MiB",
            [paged.data_dir_metric_bytes / MIB / m],
        )
        if paged.held_per_gib is not None:
            add("page-out: sessions held per GiB of RAM", "/GiB", [paged.held_per_gib])
        add("page-out: woken session's first cell", "ms", paged.wake_ms)
    return rows


def table(cells: list[list[str]], markdown: bool) -> str:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]

    def line(row: list[str]) -> str:
        parts = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        return "| " + " | ".join(parts) + " |" if markdown else "  ".join(parts).rstrip()

    rule = (
        "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        if markdown
        else "  ".join("-" * w for w in widths)
    )
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


TARGET_HEADER = ["target", "measured", "verdict"]
ROW_HEADER = ["measurement", "unit", "n", "p50", "p90", "min", "max"]


def render(
    verdict_rows: list[list[str]], rows: list[list[str]], notes: list[str], markdown: bool
) -> str:
    parts = [table([TARGET_HEADER, *verdict_rows], markdown), table([ROW_HEADER, *rows], markdown)]
    return (
        "\n\n".join(parts) + "\n\n" + "\n".join(f"- {n}" if markdown else n for n in notes) + "\n"
    )
