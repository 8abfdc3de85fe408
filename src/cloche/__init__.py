"""cloche: a fast, stateful, gVisor-isolated Python sandbox for LLM agents."""

from cloche.errors import ClocheError

__version__ = "0.1.0"

__all__ = ["ClocheError", "__version__"]
