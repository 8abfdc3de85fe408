"""Notebook-style data analysis in a cloche session: upload a CSV, explore it with pandas,
plot it with matplotlib, and download the plot.

    cloche serve &                          # or ./run.sh, on a machine with runsc
    python examples/data_analysis.py                       # a generated sales.csv
    python examples/data_analysis.py --csv mine.csv --column revenue --out plot.png

The session uses the `data` profile: numpy, pandas and matplotlib are loaded before it
starts, so importing them costs nothing. Each step is one cell; the session keeps `df`
between them, as a notebook does. CLOCHE_URL and CLOCHE_TOKEN say where the cloche server is.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
from pathlib import Path

import cloche


def sample_csv(rows: int = 365, seed: int = 7) -> str:
    """A year of daily sales in three regions."""
    rng = random.Random(seed)  # noqa: S311  # sample data, not a secret
    lines = ["date,region,units,revenue"]
    for day in range(rows):
        date = datetime.date(2024, 1, 1) + datetime.timedelta(days=day)
        weekend = date.weekday() >= 5
        for region, scale in (("north", 1.0), ("south", 1.4), ("west", 0.8)):
            units = max(0, int(rng.gauss(40 * scale, 8) + 15 * scale * weekend))
            lines.append(f"{date},{region},{units},{units * rng.uniform(9.5, 12.5):.2f}")
    return "\n".join(lines) + "\n"


def cell(session: cloche.Session, title: str, code: str) -> cloche.Execution:
    """Run one step, show what it printed and its value; stop at an error."""
    print(f"\n## {title}")
    execution = session.run(code, on_stdout=lambda text: print(text, end=""))
    if execution.error is not None:
        sys.exit(f"the cell failed:\n{execution.error.traceback_text}")
    if execution.text is not None:
        print(execution.text)
    return execution


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, help="the data (default: generated sales data)")
    parser.add_argument("--column", default="revenue", help="the numeric column to plot")
    parser.add_argument("--out", type=Path, default=Path("plot.png"), help="where the plot goes")
    args = parser.parse_args()
    data = args.csv.read_bytes() if args.csv else sample_csv().encode()

    with cloche.Client() as client, client.create_session("data") as session:
        session.upload("input.csv", data)
        cell(
            session,
            "Load",
            "import pandas as pd\n"
            "df = pd.read_csv('input.csv')\n"
            "print(f'{len(df)} rows, columns: {list(df.columns)}')\n"
            "df.head()",
        )
        cell(session, "Summary", f"df[{args.column!r}].describe().round(2)")
        if "date" in columns_of(session):
            cell(
                session,
                "By month",
                "df['month'] = pd.to_datetime(df['date']).dt.to_period('M')\n"
                f"by_month = df.groupby('month')[{args.column!r}].sum()\n"
                "by_month.round(0)",
            )
            series = "by_month"
        else:
            series = f"df[{args.column!r}]"
        plotted = cell(
            session,
            "Plot",
            f"ax = {series}.plot(figsize=(8, 4), title={args.column!r})\n"
            "ax.figure.tight_layout()\n"
            "ax.figure.savefig('plot.png', dpi=120)\n"
            "print('saved plot.png')",
        )
        shown = sum(1 for result in plotted.results if result.png)
        print(f"(the figure also came back inline: {shown} PNG result)")
        args.out.write_bytes(session.download("plot.png"))
    print(f"\nplot written to {args.out}")
    return 0


def columns_of(session: cloche.Session) -> list[str]:
    """The DataFrame's columns, read back as JSON."""
    columns = session.run("list(df.columns)").result_json
    return [str(name) for name in columns or []]


if __name__ == "__main__":
    sys.exit(main())
