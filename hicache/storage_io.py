"""StorageIO: a page store's I/O on background threads, with bounded memory.

The scheduler thread must never wait for a disk. StorageIO takes its writes and reads and runs
them on one writer thread and ``num_read_threads`` reader threads.

* Writes are best effort (the store is a cache). ``submit_write`` queues the payload (it keeps
  a reference; pass bytes nobody mutates) unless the queued bytes would exceed
  ``max_pending_write_bytes``: then the write is dropped and counted (``writes_skipped``), so a
  slow or stalled disk costs pages, never memory. Keys already stored or already queued are
  not queued twice.
* Reads return a ``concurrent.futures.Future`` resolving to the verified payload or None
  (``submit_read``), or to whether the verified payload was read into the caller's blocks
  (``submit_read_into``: straight into, say, reserved host KV pages; the blocks must stay
  untouched until the future is done or cancelled). A read of a page still waiting in the write
  queue is answered from memory at once. Beyond ``max_pending_reads`` queued reads, a read
  resolves to None (False) at once (``reads_skipped``).
* A write's payload may be a function the writer thread calls for the bytes or for a
  ``PageView`` (views of the caller's memory and a check that they still hold the page): the
  store then writes from that memory without a copy, and the caller's thread copies nothing.
* A failing store is a miss: exceptions from the store are caught and counted
  (``writes_failed``, ``reads_failed``); none reaches the caller or kills a thread.
* ``close`` stops taking work, lets the writer drain the queue until its timeout, drops what
  is left, resolves queued reads to None and joins the threads, all within ``timeout_s``
  (threads stuck in a stalled store are daemons and are left behind). The store is not closed:
  it belongs to the caller.

All methods may be called from any thread.

Starting a StorageIO lowers the process's GIL switch interval to ``SWITCH_INTERVAL_S`` at most
(``sys.setswitchinterval``; Python's default is 5 ms). Each read gives the GIL up around its
system calls and must win it back from the scheduler thread, which runs Python most of the
time; at 5 ms a turn a busy scheduler thread held readers to a third of the rate they reach at
0.5 ms (``bench_disk_path --busy-thread``, docs/results/multiturn-hicache.md). A thread that
waits for nothing costs nothing: the interpreter only switches when another thread asks.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from radixlm.hicache.storage_base import PageStore, PageView, Payload, check_key, fill_blocks

logger = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005  # the most a reader waits for the GIL after a system call


def lower_switch_interval(seconds: float = SWITCH_INTERVAL_S) -> None:
    """Lowers the process's GIL switch interval to ``seconds`` (never raises it)."""
    if sys.getswitchinterval() > seconds:
        sys.setswitchinterval(seconds)


IO_COUNTERS = (
    "writes_queued",
    "writes_skipped",  # refused at submit: over the pending-bytes bound, or closed
    "writes_done",
    "writes_failed",  # the store returned False or raised
    "writes_dropped",  # still queued when close timed out
    "reads_queued",
    "reads_skipped",  # refused at submit: too many pending reads, or closed
    "reads_from_pending",  # answered from the write queue
    "reads_done",
    "reads_failed",  # the store raised
)


@dataclass(frozen=True)
class _Write:
    key: bytes
    token_ids: tuple[int, ...]
    # the bytes, or how to get them (or a view of them) when written
    payload: bytes | Callable[[], bytes | PageView | None]
    num_bytes: int


@dataclass(frozen=True)
class _Read:
    key: bytes
    token_ids: tuple[int, ...]
    future: Future
    blocks: tuple[memoryview, ...] | None = None  # read into these (the future says True)


def _as_tuple(token_ids: Sequence[int]) -> tuple[int, ...]:
    to_list = getattr(token_ids, "tolist", None)  # numpy arrays and torch tensors
    return tuple(to_list() if to_list is not None else token_ids)


def _materialize(payload: bytes | Callable[[], bytes | PageView | None]) -> bytes | None:
    """A queued write's bytes (a copy of a view's; None if its page went stale)."""
    data = payload() if callable(payload) else payload
    return data.to_bytes() if isinstance(data, PageView) else data


def _fill_from_pending(blocks: Sequence[memoryview], payload: bytes | Callable) -> bool:
    """Copies a queued write's payload into ``blocks``: a view's blocks straight (no
    intermediate bytes), kept only if its page did not go stale meanwhile."""
    data = payload() if callable(payload) else payload
    if isinstance(data, PageView):
        return fill_blocks(blocks, data.blocks) and data.is_current()
    return data is not None and fill_blocks(blocks, data)


def _resolved(payload: bytes | bool | None) -> Future:
    future: Future = Future()
    future.set_result(payload)
    return future


class StorageIO:
    """Background reads and writes of a ``PageStore``; see the module docstring."""

    def __init__(
        self,
        store: PageStore,
        max_pending_write_bytes: int = 256 << 20,
        num_read_threads: int = 2,
        max_pending_reads: int = 1024,
        switch_interval_s: float | None = SWITCH_INTERVAL_S,
    ) -> None:
        """``switch_interval_s``: the GIL switch interval the process is lowered to (see the
        module docstring); None leaves it as it is."""
        if max_pending_write_bytes < 0 or num_read_threads < 1 or max_pending_reads < 0:
            raise ValueError(
                "StorageIO needs max_pending_write_bytes >= 0, num_read_threads >= 1 and "
                f"max_pending_reads >= 0, got {max_pending_write_bytes}, {num_read_threads}, "
                f"{max_pending_reads}"
            )
        self.store = store
        self.max_pending_write_bytes = max_pending_write_bytes
        self.max_pending_reads = max_pending_reads
        self._lock = threading.Lock()
        self._writes_changed = threading.Condition(self._lock)
        self._write_queue: OrderedDict[bytes, _Write] = OrderedDict()  # oldest first
        self._writing: dict[bytes, _Write] = {}  # taken by the writer, not finished
        self._pending_write_bytes = 0  # payload bytes queued or being written
        self._read_queue: queue.SimpleQueue[_Read | None] = queue.SimpleQueue()
        self._pending_reads = 0  # queued or being read
        self._counters = dict.fromkeys(IO_COUNTERS, 0)
        self._is_closing = False
        if switch_interval_s is not None:
            lower_switch_interval(switch_interval_s)
        self._writer = threading.Thread(target=self._write_loop, name="hicache-writer", daemon=True)
        self._readers = [
            threading.Thread(target=self._read_loop, name=f"hicache-reader-{i}", daemon=True)
            for i in range(num_read_threads)
        ]
        for thread in (self._writer, *self._readers):
            thread.start()

    # --- writes ------------------------------------------------------------------------------

    def submit_write(
        self,
        key: bytes,
        token_ids: Sequence[int],
        payload: Payload | Callable[[], bytes | PageView | None],
        num_bytes: int | None = None,
    ) -> bool:
        """Queue a write; False if it was dropped (over the bound, or closed). True also when
        the page is already stored or queued (nothing is queued then). ``payload`` may be a
        function of no arguments that the writer thread calls for the bytes (``num_bytes`` of
        them; None: the page went stale, nothing is written), which keeps the copy off the
        caller's thread."""
        check_key(key)
        if self._store_has(key):
            return True
        size = num_bytes if callable(payload) else memoryview(payload).nbytes
        if size is None:
            raise ValueError("submit_write with a payload function needs num_bytes")
        if self._pending_write_bytes + size > self.max_pending_write_bytes:
            with self._lock:  # the early answer that saves a copy; re-checked below
                self._counters["writes_skipped"] += 1
            return False
        data = payload if isinstance(payload, bytes) or callable(payload) else bytes(payload)
        with self._lock:
            if key in self._write_queue or key in self._writing:
                return True
            over = self._pending_write_bytes + size > self.max_pending_write_bytes
            if self._is_closing or over:
                self._counters["writes_skipped"] += 1
                return False
            self._write_queue[key] = _Write(key, _as_tuple(token_ids), data, size)
            self._pending_write_bytes += size
            self._counters["writes_queued"] += 1
            self._writes_changed.notify_all()
        return True

    def pending_write_bytes(self) -> int:
        """Payload bytes queued or being written."""
        with self._lock:
            return self._pending_write_bytes

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write is finished; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._writes_changed:
            while self._write_queue or self._writing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._writes_changed.wait(remaining)
        return True

    def _write_loop(self) -> None:
        while True:
            with self._writes_changed:
                while not self._write_queue and not self._is_closing:
                    self._writes_changed.wait()
                if not self._write_queue:
                    return  # closing, and everything is written
                key, item = self._write_queue.popitem(last=False)
                self._writing[key] = item
            is_stored = False
            try:
                data = item.payload() if callable(item.payload) else item.payload
                if data is not None:
                    is_stored = bool(self.store.set(item.key, item.token_ids, data))
            except Exception as error:  # a failing store loses the page, nothing else
                logger.debug("hicache: page write failed: %r", error)
            with self._writes_changed:
                del self._writing[key]
                self._pending_write_bytes -= item.num_bytes
                self._counters["writes_done" if is_stored else "writes_failed"] += 1
                self._writes_changed.notify_all()

    # --- reads -------------------------------------------------------------------------------

    def submit_read(self, key: bytes, token_ids: Sequence[int]) -> Future:
        """A future resolving to the verified payload of ``key`` or None (a miss, an error, too
        many pending reads, or closed)."""
        return self._submit(key, token_ids, None)

    def submit_read_into(
        self, key: bytes, token_ids: Sequence[int], blocks: Sequence[memoryview]
    ) -> Future:
        """A future resolving to True once the verified payload of ``key`` is in ``blocks`` (in
        order), else False (a miss, an error, too many pending reads, or closed)."""
        return self._submit(key, token_ids, tuple(blocks))

    def _submit(
        self, key: bytes, token_ids: Sequence[int], blocks: tuple[memoryview, ...] | None
    ) -> Future:
        check_key(key)
        tokens = _as_tuple(token_ids)
        with self._lock:
            pending = self._write_queue.get(key) or self._writing.get(key)
            if pending is not None and pending.token_ids == tokens:
                self._counters["reads_from_pending"] += 1
                if blocks is None:
                    return _resolved(_materialize(pending.payload))
                return _resolved(_fill_from_pending(blocks, pending.payload))
            if self._is_closing or self._pending_reads >= self.max_pending_reads:
                self._counters["reads_skipped"] += 1
                return _resolved(None if blocks is None else False)
            self._pending_reads += 1
            self._counters["reads_queued"] += 1
            future: Future = Future()
            # under the lock: close() drains the queue only after every accepted read is in it
            self._read_queue.put(_Read(key, tokens, future, blocks))
        return future

    def recycle(self, payload: Payload) -> None:
        """Gives a read's payload back to the store once copied out (stores that reuse read
        buffers take it; others ignore it). The caller must not use ``payload`` afterwards."""
        recycle = getattr(self.store, "recycle", None)
        if recycle is not None:
            try:
                recycle(payload)
            except Exception:  # a cache: a failing store only loses the buffer
                pass

    def exists(self, key: bytes) -> bool:
        """Whether ``key`` is stored or waiting in the write queue (False if the store fails)."""
        check_key(key)
        with self._lock:
            if key in self._write_queue or key in self._writing:
                return True
        return self._store_has(key)

    def any_pending(self, keys: Sequence[bytes]) -> bool:
        """Whether any of ``keys`` is still queued or being written (its source memory is
        still to be read, when the payload is a view)."""
        with self._lock:
            return any(k in self._write_queue or k in self._writing for k in keys)

    def _read_loop(self) -> None:
        while True:
            item = self._read_queue.get()
            if item is None:
                return
            self._serve(item)

    def _serve(self, item: _Read) -> None:
        payload: Payload | bool | None = None if item.blocks is None else False
        is_failed = False
        if item.future.set_running_or_notify_cancel() and not self._is_closing:
            try:
                if item.blocks is None:
                    payload = self.store.get(item.key, item.token_ids)
                else:
                    payload = self.store.get_into(item.key, item.token_ids, item.blocks)
            except Exception as error:  # a failing store is a miss
                logger.debug("hicache: page read failed: %r", error)
                is_failed = True
        with self._lock:
            self._pending_reads -= 1
            self._counters["reads_failed" if is_failed else "reads_done"] += 1
        if not item.future.cancelled():
            item.future.set_result(payload)

    # --- lifecycle and figures ----------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads (see the module docstring); idempotent, returns within about
        ``timeout_s`` even when the store stalls."""
        with self._writes_changed:
            if self._is_closing:
                return
            self._is_closing = True
            self._writes_changed.notify_all()
        deadline = time.monotonic() + timeout_s
        self._cancel_queued_reads()
        for _ in self._readers:
            self._read_queue.put(None)
        self._writer.join(max(0.0, deadline - time.monotonic()))
        self._drop_queued_writes()
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in (self._writer, *self._readers) if t.is_alive()]
        if alive:
            logger.warning("hicache: storage threads still busy after close: %s", alive)

    def _cancel_queued_reads(self) -> None:
        while True:
            try:
                item = self._read_queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._serve(item)  # closing: resolves to None without touching the store

    def _drop_queued_writes(self) -> None:
        with self._writes_changed:
            for item in self._write_queue.values():
                self._pending_write_bytes -= item.num_bytes
            self._counters["writes_dropped"] += len(self._write_queue)
            self._write_queue.clear()
            self._writes_changed.notify_all()

    def stats(self) -> dict[str, int | float]:
        """The store's counters, then this object's (queues and ``IO_COUNTERS``)."""
        try:
            store_stats = dict(self.store.stats())
        except Exception:
            store_stats = {}
        with self._lock:
            return {
                **store_stats,
                **self._counters,
                "pending_writes": len(self._write_queue) + len(self._writing),
                "pending_write_bytes": self._pending_write_bytes,
                "max_pending_write_bytes": self.max_pending_write_bytes,
                "pending_reads": self._pending_reads,
            }

    def _store_has(self, key: bytes) -> bool:
        try:
            return bool(self.store.exists(key))
        except Exception:
            return False
