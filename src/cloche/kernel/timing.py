"""`%time` and `%timeit`: measuring a cell's code, reported in IPython's words and units.

CPU times: user 1.2 ms, sys: 31 μs, total: 1.23 ms
Wall time: 1.25 ms

4.56 μs ± 12.3 ns per loop (mean ± std. dev. of 7 runs, 100,000 loops each)
"""

from __future__ import annotations

import math
import resource
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

from .ipython import translate
from .usage import UsageError

_REPEAT = 7  # %timeit's runs, as IPython (timeit's own default is 5)
_AUTORANGE_S = 0.2  # %timeit loops the first power of ten that takes this long, as IPython


def time_run(run: Callable[[], Any], *, raise_error: bool = True) -> Any:
    """Run once, then print its CPU times (the kernel's, not its commands') and wall
    time, also when it raises; its value."""
    cpu_start, wall_start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    value = None
    try:
        value = run()
    except Exception:
        if raise_error:
            raise
    finally:
        cpu_end, wall_end = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        user = cpu_end.ru_utime - cpu_start.ru_utime
        system = cpu_end.ru_stime - cpu_start.ru_stime
        print(
            f"CPU times: user {format_time(user)}, sys: {format_time(system)}, "
            f"total: {format_time(user + system)}"
        )
        print(f"Wall time: {format_time(wall_end - wall_start)}")
    return value


def timeit_run(
    options: dict[str, int], statement: str, setup: str, namespace: dict[str, Any]
) -> TimeitResult | None:
    """Time a statement (IPython syntax allowed) as `%timeit` does, and print the summary;
    the result with `-o`."""
    started = time.perf_counter()
    timer = timeit.Timer(translate(statement), translate(setup), timeit.default_timer, namespace)
    compile_time = time.perf_counter() - started
    number = options.get("n", 0)
    if number <= 0:
        for power in range(10):
            number = 10**power
            if timer.timeit(number) >= _AUTORANGE_S:
                break
    repeat = max(options.get("r", _REPEAT), 1)
    result = TimeitResult(
        number, repeat, timer.repeat(repeat, number), compile_time, options.get("p", 3)
    )
    if not options.get("q"):
        if result.worst > 4 * result.best and result.best > 0 and result.worst > 1e-6:
            print(
                f"The slowest run took {result.worst / result.best:0.2f} times longer than "
                "the fastest. This could mean that an intermediate result is being cached."
            )
        print(result)
        if compile_time > 0.1:
            print(f"Compiler time: {compile_time:.2f} s")
    return result if options.get("o") else None


def timeit_options(line: str) -> tuple[dict[str, int], str]:
    """`-n N -r R -p P -q -o` before the statement; the options and the statement.

    Raises:
        UsageError: an option IPython has and this kernel hasn't (-t, -c, -v), or a bad number.
    """
    options: dict[str, int] = {}
    words = line.lstrip().split(" ")
    while words and words[0].startswith("-") and len(words[0]) >= 2:
        word = words.pop(0)
        flag, value = word[1], word[2:]
        if flag in "nrp":
            if not value:
                value = words.pop(0) if words else ""
            if not value.isdigit():
                raise UsageError(f"%timeit -{flag} takes a number, not {value!r}")
            options[flag] = int(value)
        elif flag in "qo" and not value:
            options[flag] = 1
        elif flag.isalpha():
            raise UsageError(f"%timeit: option {word} is not available (-n, -r, -p, -q, -o are)")
        else:
            words.insert(0, word)  # `-1 + x`: the statement itself
            break
        while words and words[0] == "":
            words.pop(0)
    return options, " ".join(words)


class TimeitResult:
    """What `%timeit -o` returns: loops, repeat, best, worst, all_runs, timings (s/loop),
    average and stdev, as IPython's object of that name."""

    def __init__(
        self, loops: int, repeat: int, all_runs: list[float], compile_time: float, precision: int
    ) -> None:
        self.loops = loops
        self.repeat = repeat
        self.all_runs = all_runs
        self.compile_time = compile_time
        self.timings = [run / loops for run in all_runs]
        self.best = min(self.timings)
        self.worst = max(self.timings)
        self._precision = precision

    @property
    def average(self) -> float:
        return math.fsum(self.timings) / len(self.timings)

    @property
    def stdev(self) -> float:
        mean = self.average
        return float((math.fsum((x - mean) ** 2 for x in self.timings) / len(self.timings)) ** 0.5)

    def __str__(self) -> str:
        pm = "±" if _encodable("±") else "+-"
        mean = format_time(self.average, self._precision)
        std = format_time(self.stdev, self._precision)
        runs = "run" if self.repeat == 1 else "runs"
        loops = "loop" if self.loops == 1 else "loops"
        return (
            f"{mean} {pm} {std} per loop (mean {pm} std. dev. of {self.repeat} {runs}, "
            f"{self.loops:,} {loops} each)"
        )

    def __repr__(self) -> str:
        return f"<TimeitResult : {self}>"


def format_time(seconds: float, precision: int = 3) -> str:
    """A duration as IPython writes it: `1.23 ms`, `456 ns`, `2.1 s`, `1min 3s`."""
    if seconds >= 60.0:
        parts = []
        left = seconds
        for suffix, length in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
            value = int(left / length)
            if value > 0:
                left = left % length
                parts.append(f"{value}{suffix}")
            if left < 1:
                break
        return " ".join(parts)
    units = ["s", "ms", "μs" if _encodable("μ") else "us", "ns"]
    order = min(-(math.floor(math.log10(seconds)) // 3), 3) if seconds > 0.0 else 3
    return "%.*g %s" % (precision, seconds * (1000**order), units[order])  # noqa: UP031


def _encodable(text: str) -> bool:
    encoding = getattr(sys.stdout, "encoding", None)
    if not encoding:
        return False
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True
