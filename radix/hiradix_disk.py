"""The tiered tree's side of the disk tier: chained page keys, reads started ahead of admission,
the run of pages on disk past a node, reads waited for within a deadline, and host pages queued
for the writer thread. The tree decides; this module only talks to ``hicache.StorageIO``."""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixlm.hicache.page_hash import page_key
from radixlm.radix.hicache_stats import TierStats
from radixlm.radix.tree_node import TreeNode

if TYPE_CHECKING:
    import torch

MAX_PREFETCH_PAGES = 4096  # disk reads started ahead of admission, oldest dropped first
PREFETCH_HOST_SHARE = 0.25  # at most this share of the host pool's pages reserved by prefetch
DISK_WAIT_MIN_S = 0.05  # shortest wait for a disk read at admission
# how admission waits for a prompt's disk reads (SGLang's --hicache-storage-prefetch-policy):
# timeout: DISK_WAIT_MIN_S or a share of the recompute time; best_effort: no wait;
# wait_complete: the request stays queued until its reads ahead are done, at most this long
PREFETCH_POLICIES = ("timeout", "best_effort", "wait_complete")
WAIT_COMPLETE_MAX_S = 10.0
DISK_WAIT_SHARE = 0.5  # longest wait for disk reads, as a share of recomputing the tokens

Page = tuple[int, ...]


@dataclass
class Read:
    """A page's disk read: into the reserved host page ``page_id`` (the future says True), or,
    with ``page_id`` None, into a read buffer (the future gives the payload)."""

    future: Future | None  # None: not started yet
    page_id: int | None = None


class DiskPages:
    """Pages on disk by chained key; ``storage`` is a ``StorageIO`` (thread-safe).

    ``host_pages`` lends host pool pages to reads started ahead of admission (``reserve()`` ->
    a page id or None, ``give_back(page_id, future)``: the page goes back once its read is done
    or cancelled); without it, reads ahead go into read buffers."""

    def __init__(
        self,
        storage: Any,
        page_size: int,
        stats: TierStats,
        host_pages: Any = None,
        policy: str = "timeout",
    ) -> None:
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch policy must be one of {PREFETCH_POLICIES}, got {policy!r}")
        self.policy = policy
        self.storage = storage
        self.page_size = page_size
        self.stats = stats
        self.host_pages = host_pages
        self._prefetched: OrderedDict[bytes, Read] = OrderedDict()
        self._wanted: dict[bytes, int] = {}  # waiting requests whose prefetch named the key
        self.num_reserved = 0  # host pages lent to reads in ``_prefetched``

    def keys_after(self, prev: bytes | None, namespace: str | None, tokens: Page) -> list[bytes]:
        """The keys of the whole pages of ``tokens``, chained from the key ``prev``."""
        keys = []
        for i in range(0, len(tokens), self.page_size):
            prev = page_key(prev, namespace, tokens[i : i + self.page_size])
            keys.append(prev)
        return keys

    def _pages(self, prev: bytes | None, namespace: str | None, tokens: Page, pos: int):
        """(key, page) of each whole page of ``tokens[pos:]``, chained from ``prev``."""
        for start in range(pos, len(tokens) - self.page_size + 1, self.page_size):
            page = tokens[start : start + self.page_size]
            prev = page_key(prev, namespace, page)
            yield prev, page

    def prefetch(
        self, prev: bytes | None, namespace: str | None, tokens: Page, pos: int
    ) -> list[bytes]:
        """Starts reading the run of pages on disk after ``tokens[:pos]``; the keys of that run
        (started now or before), to be given back to :meth:`release` once the request that
        asked is admitted or gone."""
        keys = []
        for key, page in self._pages(prev, namespace, tokens, pos):
            if key not in self._prefetched:
                if not self.storage.exists(key):
                    break
                self._prefetched[key] = self._start_read(key, page)
            keys.append(key)
            self._wanted[key] = self._wanted.get(key, 0) + 1
        while len(self._prefetched) > MAX_PREFETCH_PAGES:
            self._drop(self._prefetched.popitem(last=False)[1])
        return keys

    def ready(self, keys: list[bytes], waited_s: float) -> bool:
        """Whether a request whose reads ahead are ``keys``, queued for ``waited_s`` s, may be
        admitted: always, except under ``wait_complete`` while one of them still runs (for at
        most ``WAIT_COMPLETE_MAX_S``)."""
        if self.policy != "wait_complete" or waited_s >= WAIT_COMPLETE_MAX_S:
            return True
        for key in keys:
            read = self._prefetched.get(key)
            if read is not None and not read.future.done():
                return False
        return True

    def _start_read(self, key: bytes, page: Page) -> Read:
        """A read ahead, straight into a reserved host page when one can be lent."""
        page_id = None
        if self.host_pages is not None and self.num_reserved < self.host_pages.max_reserved:
            page_id = self.host_pages.reserve()
        if page_id is None:
            return Read(self.storage.submit_read(key, page))
        self.num_reserved += 1
        blocks = self.host_pages.pool.page_blocks(page_id)
        return Read(self.storage.submit_read_into(key, page, blocks), page_id)

    def _drop(self, read: Read) -> None:
        read.future.cancel()
        if read.page_id is not None:
            self.num_reserved -= 1
            self.host_pages.give_back(read.page_id, read.future)

    def reserved_page_ids(self) -> list[int]:
        """Host pages lent to reads ahead of admission."""
        return [r.page_id for r in self._prefetched.values() if r.page_id is not None]

    def release(self, keys: list[bytes]) -> None:
        """A request that prefetched ``keys`` was admitted (its reads were used or are not
        wanted) or ended while waiting: a page no other waiting request asked for is dropped
        (an aborted request's pages no longer sit in memory until the cap pushes them out)."""
        for key in keys:
            left = self._wanted.get(key, 0) - 1
            if left > 0:
                self._wanted[key] = left
                continue
            self._wanted.pop(key, None)
            read = self._prefetched.pop(key, None)
            if read is not None:
                self._drop(read)

    @property
    def num_prefetched(self) -> int:
        """Pages read (or being read) ahead of admission and held until used or released."""
        return len(self._prefetched)

    def find(
        self, prev: bytes | None, namespace: str | None, tokens: Page, pos: int
    ) -> tuple[list[bytes], list[Page]]:
        """The keys and pages of the run on disk (or being read) after ``tokens[:pos]``."""
        keys, pages = [], []
        for key, page in self._pages(prev, namespace, tokens, pos):
            if key not in self._prefetched and not self.storage.exists(key):
                break
            keys.append(key)
            pages.append(page)
        return keys, pages

    def take_reads(self, keys: list[bytes]) -> list[Read | None]:
        """The reads started ahead for ``keys`` (None where there is none), now the caller's
        (with their host pages)."""
        reads = [self._prefetched.pop(key, None) for key in keys]
        self.num_reserved -= sum(1 for r in reads if r is not None and r.page_id is not None)
        return reads

    def read_into(
        self, keys: list[bytes], pages: list[Page], reads: list[Read], host_pool: Any
    ) -> tuple[int, list[Read]]:
        """Completes the run: ``reads[i]`` is page ``i``'s read, into its host page
        (``page_id``; reads not started yet are started here, straight into their page) or
        into a buffer read ahead (copied into the read's ``page_id`` here, which the caller
        set). Waits at most a share of what recomputing the tokens would take (a wait that
        ends in a recompute costs both); a miss, an error or a timeout ends the run. Returns
        the number of leading pages now in the pool and the reads after those (cancelled where
        they had not started: the caller gives their pages back once they are done)."""
        for i, read in enumerate(reads):
            if read.future is None:
                blocks = host_pool.page_blocks(read.page_id)
                read.future = self.storage.submit_read_into(keys[i], pages[i], blocks)
        num_tokens = len(keys) * self.page_size
        wait_s = max(DISK_WAIT_MIN_S, DISK_WAIT_SHARE * self.stats.recompute_s(num_tokens))
        if self.policy == "best_effort":
            wait_s = 0.0  # the pages read by now
        start = time.perf_counter()
        deadline = start + wait_s
        num_read = 0
        for read in reads:
            try:
                result = read.future.result(timeout=max(0.0, deadline - time.perf_counter()))
            except Exception:  # a timeout or a failing store: a miss from here on
                result = None
            if result is None or result is False:
                break
            if result is not True:  # a payload read ahead into a buffer
                host_pool.write_page_bytes(read.page_id, result)
                self.storage.recycle(result)
            num_read += 1
        for read in reads[num_read:]:
            read.future.cancel()
        if num_read:
            num_bytes = num_read * host_pool.bytes_per_page
            self.stats.on_disk_read(num_bytes, time.perf_counter() - start)
        return num_read, reads[num_read:]

    def queue_writes(self, node: TreeNode, host_pool: Any) -> None:
        """Queues the node's pages for the disk writer, which writes them from the host pool
        itself (a page freed before it is written is skipped: its generation tells)."""
        self.queue_pages(node.page_keys or [], node.key, node.host_slots, host_pool)

    def queue_pages(
        self, keys: list[bytes], tokens_all: Page, host_slots: Any, host_pool: Any
    ) -> None:
        """Queues pages ``keys`` (of ``tokens_all``, in ``host_slots``) for the disk writer."""
        pages = host_pool.page_ids(host_slots).tolist()
        for i, key in enumerate(keys):
            if self.storage.exists(key):
                continue
            tokens = tokens_all[i * self.page_size : (i + 1) * self.page_size]
            snapshot = functools.partial(  # the writer writes from the pool, without a copy
                host_pool.page_view, pages[i], host_pool.page_generation(pages[i])
            )
            if not self.storage.submit_write(key, tokens, snapshot, host_pool.bytes_per_page):
                self.stats.disk_writes_skipped += 1

    def forget_reads(self) -> None:
        for read in self._prefetched.values():
            self._drop(read)
        self._prefetched.clear()
        self._wanted.clear()

    def close(self) -> None:
        self.forget_reads()
        self.storage.close()


def last_key(node: TreeNode) -> bytes | None:
    """The key of the node's last page (None for a root: the chain starts there)."""
    return node.page_keys[-1] if node.page_keys else None


@dataclass
class StagedWrite:
    """A leaf's pages copied into host pages it does not keep, on their way to the disk."""

    key: tuple[int, ...]
    keys: list[bytes]
    host: torch.Tensor
    op: Any
    queued: bool = False


class HostPageLender:
    """Lends the tree's free host pages to disk reads started ahead of admission (no eviction
    for them: at most ``PREFETCH_HOST_SHARE`` of the pool)."""

    def __init__(self, cache: Any) -> None:  # a HiRadixCache
        self.cache = cache
        self.pool = cache.host_pool
        self.max_reserved = int(self.pool.num_pages * PREFETCH_HOST_SHARE)

    def reserve(self) -> int | None:
        slots = self.pool.alloc(self.pool.page_size)
        return None if slots is None else int(slots[0]) // self.pool.page_size

    def give_back(self, page_id: int, future: Any) -> None:
        self.cache._give_back_page(page_id, future)
