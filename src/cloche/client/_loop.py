"""An event loop on a daemon thread: what the blocking facades (`sync.py`,
`sync_processes.py`) run the async client's coroutines on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop on a daemon thread, for one client's coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="cloche-client", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Ctrl-C must reach the thread that waits for a call, never this one (nor threads it
        # starts, which inherit the mask): a signal taken here would not wake the waiter.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine there and wait; Ctrl-C (or any exit) cancels it."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        if self._thread.is_alive():
            self.call(self.loop.shutdown_asyncgens())  # those a cancelled call left open
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
