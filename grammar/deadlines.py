"""One thread that runs callbacks at their deadlines (the compile cache's timeouts).

A ``threading.Timer`` per compilation is a thread per cache miss: a client sending thousands of
distinct grammars held thousands of sleeping threads for the whole timeout. Here every deadline
waits in one heap served by one daemon thread, started on first use. ``cancel`` forgets the
callback at once (what it refers to is freed); its heap entry goes when its time comes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Deadlines:
    def __init__(self, name: str = "grammar-deadlines", clock=time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self._heap: list[tuple[float, int]] = []
        self._callbacks: dict[int, Callable[[], object]] = {}  # the pending ones, by handle
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def call_after(self, delay_s: float, callback: Callable[[], object]) -> int:
        """Runs ``callback()`` on the deadline thread about ``delay_s`` seconds from now; the
        handle returned can be given to :meth:`cancel`."""
        handle = next(self._seq)
        with self._cond:
            if self._closed:  # shut down: nothing runs any more
                return handle
            heapq.heappush(self._heap, (self.clock() + delay_s, handle))
            self._callbacks[handle] = callback
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return handle

    def cancel(self, handle: int) -> None:
        """The callback will not run (a no-op when it ran already)."""
        with self._cond:
            self._callbacks.pop(handle, None)

    def close(self) -> None:
        """Drops every pending callback and ends the thread (its owner is shutting down)."""
        with self._cond:
            self._closed = True
            self._callbacks.clear()
            self._heap.clear()
            self._cond.notify()

    def __len__(self) -> int:
        """Callbacks still pending."""
        with self._cond:
            return len(self._callbacks)

    def _next_due(self) -> Callable[[], object] | None:
        """Waits for the earliest pending deadline; its callback (under the condition), or
        None once closed."""
        while not self._closed:
            while self._heap and self._heap[0][1] not in self._callbacks:
                heapq.heappop(self._heap)  # cancelled
            if not self._heap:
                self._cond.wait()
                continue
            due_s, handle = self._heap[0]
            wait_s = due_s - self.clock()
            if wait_s <= 0:
                heapq.heappop(self._heap)
                return self._callbacks.pop(handle)
            self._cond.wait(wait_s)
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                callback = self._next_due()
            if callback is None:
                return
            try:
                callback()
            except Exception:  # a failing callback must not stop the others' deadlines
                logger.exception("deadline callback failed")
