"""matplotlib figures as PNG displays, as Jupyter's inline backend shows them.

Once pyplot is imported, `plt.show()` displays the open figures and closes them; figures still
open when a cell ends are displayed then too. Nothing here imports matplotlib itself.
"""

from __future__ import annotations

import base64
import io
import sys
import warnings
from collections.abc import Callable
from typing import Any

Emit = Callable[[dict[str, Any]], None]

# Before show() is taken over (in the cell that first imports pyplot), Agg's show() would warn.
warnings.filterwarnings("ignore", message=".*non-GUI backend.*")
warnings.filterwarnings("ignore", message=".*FigureCanvasAgg is non-interactive.*")


class FigureCapture:
    """Turns open pyplot figures into `image/png` MIME bundles."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self._pyplot: Any = None

    def flush(self) -> None:
        """Display and close every open figure (called at the end of each cell)."""
        pyplot: Any = self._pyplot or sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        if self._pyplot is None:
            self._pyplot = pyplot

            def show(*args: object, **kwargs: object) -> None:
                """Display the open figures (as PNG) and close them."""
                self._show()

            pyplot.show = show  # a plain function: pyplot sets attributes on it
        self._show()

    def _show(self, *args: object, **kwargs: object) -> None:
        pyplot = self._pyplot
        try:
            numbers = list(pyplot.get_fignums())
        except Exception:
            return
        for number in numbers:
            try:
                figure = pyplot.figure(number)
                buffer = io.BytesIO()
                figure.savefig(buffer, format="png", bbox_inches="tight")
                text = repr(figure)
            except Exception:  # noqa: S112  # a figure that can't render is skipped
                continue
            self._emit(
                {
                    "image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
                    "text/plain": text,
                }
            )
        try:
            pyplot.close("all")
        except Exception:  # noqa: S110
            pass
