"""The core benchmark's figures: statistics of samples, verdicts against the targets,
and both as tables (text, or markdown).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Stats:
    """Summary of one sample set, in the unit it was taken in."""

    n: int
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        if not samples:
            raise ValueError("no samples")
        if len(samples) == 1:
            only = samples[0]
            return cls(1, only, only, only, only)
        cuts = statistics.quantiles(samples, n=100, method="inclusive")
        return cls(len(samples), cuts[49], cuts[89], cuts[98], max(samples))


@dataclass(frozen=True)
class Row:
    what: str
    unit: str
    stats: Stats


@dataclass(frozen=True)
class Verdict:
    target: str
    measured: str
    verdict: str


def fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def render(verdicts: list[Verdict], rows: list[Row], markdown: bool) -> str:
    """The targets table (ratios first), then every measurement."""
    target_table = [
        ["target", "measured", "verdict"],
        *([v.target, v.measured, v.verdict] for v in verdicts),
    ]
    latency_table = [
        ["measurement", "unit", "n", "p50", "p90", "p99", "max"],
        *(
            [
                r.what,
                r.unit,
                str(r.stats.n),
                fmt(r.stats.p50),
                fmt(r.stats.p90) if r.stats.n >= 10 else "-",  # too few samples to mean much
                fmt(r.stats.p99) if r.stats.n >= 20 else "-",
                fmt(r.stats.max),
            ]
            for r in rows
        ),
    ]
    return "\n\n".join(_table(t, markdown) for t in (target_table, latency_table)) + "\n"


def _table(cells: list[list[str]], markdown: bool) -> str:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    numeric = [i > 0 and all(_is_number(row[i]) for row in cells[1:]) for i in range(len(widths))]

    def line(row: list[str]) -> str:
        parts = [
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(row, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(parts) + " |" if markdown else "  ".join(parts).rstrip()

    if markdown:
        rule = "|" + "|".join(
            "-" * (w + 1) + ":" if right else "-" * (w + 2)
            for w, right in zip(widths, numeric, strict=True)
        )
        rule += "|"
    else:
        rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _is_number(text: str) -> bool:
    if text == "-":
        return True
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True
