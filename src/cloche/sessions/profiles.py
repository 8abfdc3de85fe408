"""Session profiles: what a sandbox has imported before its first cell.

`lean` starts with nothing imported (small, ~15 MiB). `data` has the data stack imported
(~190 MiB, 2-2.6 s of imports inside gVisor), so that `import pandas` in a cell costs nothing.
Each profile has its own warm pool. A profile with `restored` set is started afresh once;
its pool then restores copies of that sandbox's checkpoint, which is several times faster
than starting and importing again (measured for `data`: ~0.9 s against ~5.5 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cloche.errors import UnknownProfile
from cloche.sandbox.layers import System

PYTHON = "python"  # the built-in template: the host's /usr and cloche's runtime


@dataclass(frozen=True)
class Profile:
    """A kind of session: code run once, silently, when its sandbox starts."""

    name: str
    preload: str = ""
    restored: bool = False  # refill the pool from a checkpoint of one started sandbox
    runtime_dir: Path | None = None  # its own site-packages (a profile from --profiles)
    system: System | None = None  # the template its sandboxes are made of; None: python


LEAN = Profile("lean")
DATA = Profile(
    "data",
    preload=(
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot\n"
        "import numpy, pandas, scipy, scipy.stats, sympy\n"
    ),
    restored=True,
)
PROFILES = {profile.name: profile for profile in (LEAN, DATA)}


def get_profile(name: str) -> Profile:
    """The profile called name. Raises UnknownProfile."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownProfile(
            f"unknown profile {name!r}; choose one of {', '.join(sorted(PROFILES))}"
        ) from None
