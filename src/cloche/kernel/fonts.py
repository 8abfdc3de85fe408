"""matplotlib's font list, shipped built with the runtime (`cloche.sandbox.fonts`).

At start, the kernel links each `fontlist-v*.json` of the first `.cloche/matplotlib/` on its
sys.path (the runtime's, mounted read-only) into MPLCONFIGDIR, where matplotlib looks for
it: the first plot of a session reads the list instead of scanning every font. matplotlib
never writes it there (a list it finds is used as is); were it to rebuild one (a font
removed since), its write fails on the read-only mount and it keeps what it built.
"""

from __future__ import annotations

import os
import sys

SHIPPED = os.path.join(".cloche", "matplotlib")  # under the runtime's site-packages


def link_font_list() -> None:
    """Link the runtime's font list into MPLCONFIGDIR (nothing if either is missing)."""
    config_dir = os.environ.get("MPLCONFIGDIR")
    if not config_dir:
        return
    for entry in sys.path:
        shipped = os.path.join(entry, SHIPPED)
        try:
            names = [n for n in os.listdir(shipped) if n.startswith("fontlist-")]
        except OSError:
            continue
        try:
            os.makedirs(config_dir, exist_ok=True)
            for name in names:
                os.symlink(os.path.join(shipped, name), os.path.join(config_dir, name))
        except OSError:  # matplotlib builds its own, as without one
            pass
        return
