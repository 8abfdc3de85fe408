"""Sandbox backends: where a kernel runs. gVisor for real; unsafe_local for machines without it."""

from cloche.sandbox.base import Backend, Sandbox
from cloche.sandbox.registry import create_backend

__all__ = ["Backend", "Sandbox", "create_backend"]
