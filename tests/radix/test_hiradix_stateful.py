"""Randomized admissions, insertions, releases, matches, loads, prefetches, evictions, host
pressure, resets and restarts of a HiRadixCache on real CPU tiers (``TieredKV`` from
hiradix_world.py), against a brute-force model of what was ever inserted; page sizes 1 and
4, each write policy; with or without a disk tier (roomy, or small enough to evict pages), a
small or large host pool, and copies run at once or only when waited for.

The model keeps every page ever inserted, keyed by (namespace, tokens up to the page's end), and
the running requests with the slots they hold. Which tier a page sits in depends on LRU order,
host-pool pressure, the write policy and the measured rates, so hit lengths are checked where
they are determined and the rest is checked for being right rather than for being long:

* never a wrong hit: every matched page was inserted under that namespace, and the matched
  device slots hold exactly that prefix's KV (``TieredKV.check_values``); so do every node's
  device and host copies after every step, through evictions, load-backs, disk round trips
  and restarts (which poison the device buffers and empty the device and host tiers);
* ``match_prefix`` answers exactly the device part the tree holds and moves nothing;
  ``match_and_load`` answers that device part plus all of the host part or none of it (then
  maybe disk pages); a running request's locked prefix stays on the device at its slots;
* ``evict(n)`` frees at least ``min(n, evictable)`` device tokens, only unlocked ones; host
  pressure frees exactly what it reports;
* every device page is free in the allocator, held by the tree or held by one running request,
  once; every host page is free or held by the tree, once; ``check_integrity`` holds.

Disk writes are flushed after every step and reads may wait long (a slow measured prefill), so
a run does not depend on the storage threads' timing (Hypothesis replays runs exactly).
"""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
from hiradix_world import Request, TieredKV, slow_prefill, tier_profile
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from quick import examples

from radixlm.hicache.page_file import HEADER_SIZE

PageKey = tuple[str | None, tuple[int, ...]]
NAMESPACES = st.sampled_from([None, "lora-a"])
DEVICE_PAGES = 6
BYTES_PER_TOKEN = 32  # 2 layers x (K, V) x 1 head x 2 dims x float32


def token_lists(page_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Sequences of 1 to 4 pages and a bit (lengths drawn evenly, not small-first)."""
    alphabet = st.sampled_from(range(3) if page_size == 1 else range(2))
    lengths = st.sampled_from(range(page_size, 4 * page_size + 4))
    return lengths.flatmap(lambda n: st.lists(alphabet, min_size=n, max_size=n).map(tuple))


class HiRadixMachineBase(RuleBasedStateMachine):
    page_size = 1
    policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        self.world: TieredKV | None = None
        self.disk_dir: str | None = None
        self.running: list[Request] = []
        self.inserted: set[PageKey] = set()  # every page ever inserted
        self.history: list[tuple[tuple[int, ...], str | None]] = []

    @initialize(
        has_disk=st.booleans(),
        host_pages=st.sampled_from([2, 4, 12]),
        disk_pages=st.sampled_from([6, 1000]),
        lazy=st.booleans(),
    )
    def build(self, has_disk: bool, host_pages: int, disk_pages: int, lazy: bool) -> None:
        """``disk_pages``: what the disk tier holds before evicting its LRU pages; ``lazy``:
        copies run only when waited for (the latest an asynchronous engine may)."""
        ps = self.page_size
        self.disk_dir = tempfile.mkdtemp(prefix="hiradix-") if has_disk else None
        self.world = TieredKV(
            ps,
            DEVICE_PAGES * ps,
            host_pages * ps,
            self.policy,
            disk_dir=self.disk_dir,
            disk_max_bytes=disk_pages * (HEADER_SIZE + 8 * ps + ps * BYTES_PER_TOKEN),
            lazy_copies=lazy,
        )
        slow_prefill(self.world)  # disk reads wait long: hits do not depend on timing

    # --------------------------------------------------------------------------- helpers

    @property
    def cache(self):
        return self.world.cache

    def draw_tokens(self, data: st.DataObject, namespace: str | None) -> tuple[int, ...]:
        """A fresh sequence, an earlier one (as it was, or cut short and extended), or one
        whose match would load from host memory."""
        fresh = token_lists(self.page_size)
        choice = data.draw(st.integers(0, 3)) if self.history else 0
        if choice == 0:
            return data.draw(fresh)
        if choice == 3:
            spilled = [
                t
                for t, ns in self.history
                if ns == namespace and tier_profile(self.cache, t, ns)[1]
            ]
            if spilled:
                return data.draw(st.sampled_from(spilled))
        base = data.draw(st.sampled_from(self.history))[0]
        if choice != 2:
            return base
        cut = data.draw(st.sampled_from(range(len(base), -1, -1)))
        tail = data.draw(fresh)[: data.draw(st.sampled_from(range(2 * self.page_size + 1)))]
        return base[:cut] + tail

    def page_keys(self, tokens, namespace, num_tokens: int) -> set[PageKey]:
        ps = self.page_size
        return {(namespace, tuple(tokens[:end])) for end in range(ps, num_tokens + 1, ps)}

    def check_hit(self, tokens, namespace, matched_len: int) -> None:
        unknown = self.page_keys(tokens, namespace, matched_len) - self.inserted
        assert not unknown, f"matched pages never inserted: {sorted(unknown)[:3]}"

    def remember_insert(self, req: Request) -> None:
        num = self.cache.cacheable_len(len(req.tokens))
        self.inserted |= self.page_keys(req.tokens, req.namespace, num)
        self.history.append((req.tokens, req.namespace))

    def pick(self, index: int, inserted: bool | None = None) -> Request | None:
        pool = [r for r in self.running if inserted is None or r.is_inserted == inserted]
        return pool[index % len(pool)] if pool else None

    # --------------------------------------------------------------------------- requests

    @rule(data=st.data(), namespace=NAMESPACES, insert_now=st.booleans())
    def admit(self, data: st.DataObject, namespace: str | None, insert_now: bool) -> None:
        """The scheduler's admission: match_and_load + lock, slots for the rest, KV written."""
        tokens = self.draw_tokens(data, namespace)
        limit = len(tokens) - data.draw(st.integers(0, 1)) if tokens else 0
        req = self.world.admit(tokens, namespace, limit)
        if req is None:
            return
        self.check_hit(tokens, namespace, req.num_cached)
        self.running.append(req)
        if insert_now:
            self.world.insert(req)
            self.remember_insert(req)

    @rule(data=st.data(), namespace=NAMESPACES)
    def run_request(self, data: st.DataObject, namespace: str | None) -> None:
        """A whole request (admitted, inserted, finished) between two other steps."""
        tokens = self.draw_tokens(data, namespace)
        req = self.world.admit(tokens, namespace, max(len(tokens) - 1, 0))
        if req is None:
            return
        self.check_hit(tokens, namespace, req.num_cached)
        self.remember_insert(req)
        self.world.release(req)

    @precondition(lambda self: any(not r.is_inserted for r in self.running))
    @rule(index=st.integers(0, 7))
    def insert_running(self, index: int) -> None:
        """cache_chunk of a request admitted earlier (the tree changed meanwhile)."""
        req = self.pick(index, inserted=False)
        self.world.insert(req)
        self.remember_insert(req)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 7), keep_in_cache=st.booleans())
    def release(self, index: int, keep_in_cache: bool) -> None:
        req = self.pick(index)
        if keep_in_cache and not req.is_inserted:
            self.remember_insert(req)
        self.world.release(req, keep_in_cache)
        self.running.remove(req)

    # --------------------------------------------------------------------------- matches

    @rule(data=st.data(), namespace=NAMESPACES)
    def match_prefix(self, data: st.DataObject, namespace: str | None) -> None:
        tokens = self.draw_tokens(data, namespace)
        self.history.append((tokens, namespace))
        self.check_hit(tokens, namespace, self.world.match_prefix(tokens, namespace).matched_len)

    @rule(data=st.data(), namespace=NAMESPACES)
    def match_and_load(self, data: st.DataObject, namespace: str | None) -> None:
        tokens = self.draw_tokens(data, namespace)
        self.history.append((tokens, namespace))
        result = self.world.match_and_load(tokens, namespace)
        self.check_hit(tokens, namespace, result.matched_len)

    @precondition(lambda self: self.disk_dir is not None)
    @rule(data=st.data(), namespace=NAMESPACES)
    def prefetch(self, data: st.DataObject, namespace: str | None) -> None:
        self.cache.prefetch(self.draw_tokens(data, namespace), namespace)

    @rule(recompute_is_fast=st.booleans())
    def observe_prefill(self, recompute_is_fast: bool) -> None:
        """A prefill rate that makes every load look slower (fast) or worthwhile (slow)."""
        if recompute_is_fast:
            for _ in range(100):
                self.cache.observe_prefill(10**6, 1e-6)
        else:
            slow_prefill(self.world)

    # --------------------------------------------------------------------------- memory

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        ps = self.page_size
        num_tokens = data.draw(st.sampled_from([0, ps, 3 * ps, DEVICE_PAGES * ps]))
        evictable, protected = self.cache.evictable_size(), self.cache.protected_size()
        num_freed = self.cache.evict(num_tokens)
        assert num_freed >= min(num_tokens, evictable), "evict stopped early"
        assert self.cache.protected_size() == protected, "evict touched a locked node"
        assert self.cache.evictable_size() == evictable - num_freed

    @rule(data=st.data())
    def host_pressure(self, data: st.DataObject) -> None:
        """The host pool makes room (as a backup or a disk read would)."""
        pool = self.world.host_pool
        num_tokens = data.draw(st.integers(1, pool.total_size()))
        available = pool.available_size()
        num_freed = self.cache._evict_host(num_tokens, set())
        assert pool.available_size() == available + num_freed

    @precondition(lambda self: self.world is not None and self.world.lazy_copies)
    @rule()
    def finish_copies(self) -> None:
        """The copy streams catch up."""
        self.world.engine.finish_all()

    @precondition(lambda self: not self.running)
    @rule(restart=st.booleans())
    def reset(self, restart: bool) -> None:
        """Drop both tiers, or restart: a new process over the same disk folder."""
        if restart and self.disk_dir is not None:
            self.world.restart()
            slow_prefill(self.world)
        else:
            self.cache.reset()
        self.check_empty()

    def check_empty(self) -> None:
        assert self.cache.total_size() == 0
        assert not self.world.ledger.outstanding, "device pages leaked by reset"
        assert self.world.host_pool.used_size() == 0, "host pages leaked by reset"

    # --------------------------------------------------------------------------- checks

    @invariant()
    def tiers_are_consistent(self) -> None:
        if self.world is not None:
            self.world.flush()  # disk contents do not depend on the writer thread's timing
            self.world.check_all(self.running)

    def teardown(self) -> None:
        if self.world is None:
            return
        try:
            while self.running:
                self.release(0, keep_in_cache=True)
                self.world.check_all(self.running)
            self.reset(restart=False)
        finally:
            self.world.close()
            if self.disk_dir is not None:
                shutil.rmtree(self.disk_dir, ignore_errors=True)


_SETTINGS = settings(
    max_examples=examples(25),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _machine(page_size: int, policy: str):
    name = f"HiRadixMachine_{policy}_page{page_size}"
    machine = type(name, (HiRadixMachineBase,), {"page_size": page_size, "policy": policy})
    test_case = machine.TestCase
    test_case.settings = _SETTINGS
    return test_case


TestWriteThroughPage1 = _machine(1, "write_through")
TestWriteThroughPage4 = _machine(4, "write_through")
TestSelectivePage1 = _machine(1, "write_through_selective")
TestSelectivePage4 = _machine(4, "write_through_selective")
TestWriteBackPage1 = _machine(1, "write_back")
TestWriteBackPage4 = _machine(4, "write_back")
