"""A test harness for HiRadixCache on real CPU objects: device KV buffers, the slot allocator, a host KV pool, the
synchronous copy engine (or a lazy one that runs each copy only when it is waited for), the
controller and, for the disk tier, a DiskPageStore behind StorageIO, optionally wrapped in the
fault-injecting FaultyStore.

Every KV slot written by a test holds a value derived from (namespace, token prefix up to that
position), in every layer's K and V; freed device slots are poisoned. So after evictions to
host, load-backs, disk round trips and restarts, a match whose slots do not hold exactly the
values of its prefix (a wrong load, a misplaced page, a wrong disk hit, a namespace crossing)
fails ``TieredKV.check_values``. ``TieredKV.check_all`` adds the accounting: every device page
is free in the allocator, held by the tree or held by a running request, once; every host page
is free or held by the tree, once; every node's device and host copies hold its prefix's
values. The harness of ``test_hiradix_host.py``, ``test_hiradix_disk.py`` and
``test_hiradix_stateful.py``; ``make_world`` reaches them through ``conftest.py``.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import zlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
import torch

from radixlm.hicache.controller import HiCacheController
from radixlm.hicache.copy_engine import CopyEngine, CopyOp, SyncCopyEngine
from radixlm.hicache.disk_store import DiskPageStore
from radixlm.hicache.host_pool import HostKVPool
from radixlm.hicache.storage_io import StorageIO
from radixlm.radix.base import MatchResult
from radixlm.radix.hiradix_cache import HiRadixCache
from radixlm.radix.tree_node import TreeNode, child_key, iter_subtree
from radixlm.srt.executor.memory_pool import TokenSlotAllocator


def _load_faulty_store():
    """tests/hicache/faulty_store.py (tests/ is not a package: load it by path)."""
    if "faulty_store" not in sys.modules:
        path = Path(__file__).parents[1] / "hicache" / "faulty_store.py"
        spec = importlib.util.spec_from_file_location("faulty_store", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["faulty_store"] = module
        spec.loader.exec_module(module)
    return sys.modules["faulty_store"]


faulty_store = _load_faulty_store()
FaultyStore = faulty_store.FaultyStore

LAYERS, HEADS, HEAD_DIM = 2, 1, 2
DTYPE = torch.float32
POISON = -12345.0  # written into every freed device slot
FINGERPRINT = {"model": "hiradix-test", "layers": LAYERS, "heads": HEADS, "dim": HEAD_DIM}
SLOW_PREFILL_S_PER_TOKEN = 0.5  # makes disk reads wait long enough on a busy machine


# ------------------------------------------------------------------------------ values


def kv_value(namespace: str | None, prefix: tuple[int, ...]) -> float:
    """The value every layer's KV of the last token of ``prefix`` holds (exact in float32)."""
    return float(zlib.crc32(repr((namespace, prefix)).encode()) % (1 << 20))


def expected_kv(namespace: str | None, tokens: tuple[int, ...], start: int, end: int):
    """[end - start, LAYERS, 2, HEADS, HEAD_DIM]: K is (v, layer), V is (-v, layer + 0.5) for
    the value v of each position ``start..end-1``."""
    values = torch.tensor([kv_value(namespace, tokens[: i + 1]) for i in range(start, end)])
    out = torch.empty(end - start, LAYERS, 2, HEADS, HEAD_DIM, dtype=DTYPE)
    for layer in range(LAYERS):
        out[:, layer, 0, :, 0] = values[:, None]
        out[:, layer, 0, :, 1] = layer
        out[:, layer, 1, :, 0] = -values[:, None]
        out[:, layer, 1, :, 1] = layer + 0.5
    return out


# ------------------------------------------------------------------------------ lazy copies


class LazyOp(CopyOp):
    """A copy that runs only when it is waited for: the latest an asynchronous engine may
    run it. ``wait`` first runs the earlier copies of the same direction (issue order)."""

    def __init__(self, run, num_bytes: int, queue: list[LazyOp]) -> None:
        super().__init__(num_bytes, seconds=None)
        self._run = run
        self._queue = queue
        queue.append(self)

    def done(self) -> bool:
        return self._run is None

    def wait(self) -> None:
        while self._run is not None:
            first = self._queue.pop(0)
            run, first._run = first._run, None
            run()
            first._seconds = 1e-6

    def make_stream_wait(self, stream=None) -> None:
        self.wait()  # on the CPU the "stream" is the caller: it waits here


class LazyCopyEngine(CopyEngine):
    """SyncCopyEngine's copies, run late: the device KV a write reads, and the host pages a
    load reads, are read when the op is waited for, so a cache that frees or reuses them
    before waiting stores (or loads) the wrong values."""

    def __init__(self) -> None:
        self.sync = SyncCopyEngine()
        self.writes: list[LazyOp] = []
        self.loads: list[LazyOp] = []

    def write(self, k_buffers, v_buffers, device_slots, host_pool, host_slots, after=()):
        dev, host = device_slots.clone(), host_slots.clone()
        run = partial(self.sync.write, k_buffers, v_buffers, dev, host_pool, host, after)
        return LazyOp(run, host.numel() * host_pool.bytes_per_token, self.writes)

    def load(self, host_pool, host_slots, k_buffers, v_buffers, device_slots, after=()):
        dev, host = device_slots.clone(), host_slots.clone()
        run = partial(self.sync.load, host_pool, host, k_buffers, v_buffers, dev, after)
        return LazyOp(run, host.numel() * host_pool.bytes_per_token, self.loads)

    def finish_all(self) -> None:
        for queue in (self.writes, self.loads):
            if queue:
                queue[-1].wait()


# ------------------------------------------------------------------------------ device slots


class SlotLedger:
    """The real TokenSlotAllocator, with every page's owner tracked: a page is free or
    outstanding, frees must cover whole outstanding pages (no double free, no partial page),
    and freed slots are poisoned so that reading them later shows."""

    def __init__(self, num_slots: int, page_size: int, k: list, v: list) -> None:
        self.allocator = TokenSlotAllocator(num_slots, page_size, torch.device("cpu"))
        self.size = self.allocator.max_total_tokens
        self.page_size = page_size
        self.k, self.v = k, v
        self.outstanding: set[int] = set()  # pages handed out and not freed

    def pages_of(self, slots: torch.Tensor | list[int]) -> list[int]:
        slots = torch.as_tensor(slots, dtype=torch.int64)
        return sorted(set(((slots - 1) // self.page_size).tolist()))

    def available(self) -> int:
        return self.allocator.available_size()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.allocator.alloc(num_tokens)
        if slots is not None:
            pages = self.pages_of(slots)
            assert not self.outstanding & set(pages), "the allocator handed out a used page"
            self.outstanding.update(pages)
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        assert slots.numel() % self.page_size == 0, f"freed a partial page: {slots.tolist()}"
        pages = self.pages_of(slots)
        assert len(pages) * self.page_size == slots.numel(), f"not whole pages: {slots.tolist()}"
        assert set(pages) <= self.outstanding, f"double free of pages {pages}"
        self.outstanding.difference_update(pages)
        for buf in (*self.k, *self.v):
            buf[slots] = POISON
        self.allocator.free(slots)


# ------------------------------------------------------------------------------ requests


@dataclass
class Request:
    """A running request: ``slots[:num_cached]`` are the cache's (locked through ``node``),
    ``slots[num_cached:]`` and ``spare`` (the unused tail of its last page) are its own."""

    tokens: tuple[int, ...]
    namespace: str | None
    slots: list[int]
    num_cached: int
    node: object
    spare: list[int] = field(default_factory=list)
    is_inserted: bool = False

    def own_slots(self) -> list[int]:
        return self.slots[self.num_cached :] + self.spare


# ------------------------------------------------------------------------------ the world


class TieredKV:
    """Device buffers, the ledger, a host pool, the controller, the disk tier (when
    ``disk_dir``) and the HiRadixCache over them; the scheduler protocol; the checks."""

    def __init__(
        self,
        page_size: int,
        num_slots: int,
        host_tokens: int,
        policy: str = "write_through",
        disk_dir: str | Path | None = None,
        fault_mode: str | None = None,
        stall_s: float = 0.0,
        disk_max_bytes: int = 1 << 24,
        lazy_copies: bool = False,
        max_pending_write_bytes: int = 1 << 20,
        prefetch_policy: str = "timeout",
    ) -> None:
        self.page_size = page_size
        self.prefetch_policy = prefetch_policy
        self.num_slots = num_slots
        self.host_tokens = host_tokens
        self.policy = policy
        self.disk_dir = disk_dir
        self.fault_mode = fault_mode
        self.stall_s = stall_s
        self.disk_max_bytes = disk_max_bytes
        self.lazy_copies = lazy_copies
        self.max_pending_write_bytes = max_pending_write_bytes
        self.store = self.faulty = None
        self.build()

    def build(self) -> None:
        shape = (self.num_slots + 1, HEADS, HEAD_DIM)
        self.k = [torch.full(shape, POISON, dtype=DTYPE) for _ in range(LAYERS)]
        self.v = [torch.full(shape, POISON, dtype=DTYPE) for _ in range(LAYERS)]
        self.ledger = SlotLedger(self.num_slots, self.page_size, self.k, self.v)
        self.host_pool = HostKVPool(
            self.host_tokens, self.page_size, LAYERS, HEADS, HEAD_DIM, DTYPE
        )
        self.engine = LazyCopyEngine() if self.lazy_copies else SyncCopyEngine()
        self.controller = HiCacheController(
            self.k, self.v, self.host_pool, self.engine, calibration_bytes=1024
        )
        storage = None
        if self.disk_dir is not None:
            self.store = DiskPageStore(self.disk_dir, FINGERPRINT, self.disk_max_bytes)
            inner = self.store
            if self.fault_mode is not None:
                self.faulty = inner = FaultyStore(self.store, self.fault_mode, self.stall_s)
            storage = StorageIO(inner, self.max_pending_write_bytes)
        self.cache = HiRadixCache(
            page_size=self.page_size,
            free_slots=self.ledger.free,
            alloc_slots=self.alloc_for_cache,
            controller=self.controller,
            storage=storage,
            write_policy=self.policy,
            prefetch_policy=self.prefetch_policy,
        )

    def alloc_for_cache(self, num_tokens: int) -> torch.Tensor | None:
        """As KVManager.alloc_for_cache: evict from the cache when short."""
        short = num_tokens - self.ledger.available()
        if short > 0:
            self.cache.evict(short)
        return self.ledger.alloc(num_tokens)

    def flush(self) -> None:
        if self.cache.storage is not None:
            self.cache.tier_stats()  # folds finished copies in: their pages are queued
            assert self.cache.storage.flush(timeout_s=10.0), "disk writes did not finish"

    def restart(self, fault_mode: str | None = None, stall_s: float = 0.0) -> None:
        """A new process over the same disk folder: device and host tiers start empty, the
        device buffers hold garbage, the disk is warm."""
        self.cache.reset()
        self.flush()
        self.cache.close()
        if self.faulty is not None:
            self.faulty.release()
        self.store.close()
        self.fault_mode, self.stall_s = fault_mode, stall_s
        self.build()

    def close(self) -> None:
        if self.faulty is not None:
            self.faulty.release()
        self.cache.close()
        if self.store is not None:
            self.store.close()

    # --------------------------------------------------------------------------- values

    def write_values(self, namespace, tokens, slots: list[int], start: int) -> None:
        """What a prefill does: KV of positions ``start..`` into ``slots``."""
        exp = expected_kv(namespace, tokens, start, start + len(slots))
        index = torch.tensor(slots, dtype=torch.int64)
        for layer in range(LAYERS):
            self.k[layer][index] = exp[:, layer, 0]
            self.v[layer][index] = exp[:, layer, 1]

    def device_rows(self, slots) -> torch.Tensor:
        index = torch.as_tensor(slots, dtype=torch.int64)
        rows = [torch.stack([self.k[i][index], self.v[i][index]], 1) for i in range(LAYERS)]
        return torch.stack(rows, 1)

    def host_rows(self, host_slots: torch.Tensor) -> torch.Tensor:
        data = self.host_pool.data  # [layers, pages, 2, page_size, heads, dim]
        per_slot = data.permute(1, 3, 0, 2, 4, 5).reshape(-1, LAYERS, 2, HEADS, HEAD_DIM)
        return per_slot[host_slots]

    def check_values(self, namespace, tokens, slots, start: int = 0) -> None:
        """``slots`` hold the KV of ``tokens[start : start + len(slots)]`` under namespace."""
        slots = torch.as_tensor(slots, dtype=torch.int64).cpu()
        if slots.numel() == 0:
            return
        exp = expected_kv(namespace, tuple(tokens), start, start + slots.numel())
        got = self.device_rows(slots)
        bad = (got != exp).flatten(1).any(1).nonzero().flatten().tolist()
        assert not bad, f"wrong KV at positions {[start + i for i in bad]} of {namespace!r}"

    # --------------------------------------------------------------------------- protocol

    def match_and_load(self, tokens, namespace=None) -> MatchResult:
        """match_and_load with its checks: it answers the device part it had before, plus all
        of the host part (and maybe disk pages) or none of it; the slots hold the values."""
        device_len, host_len = tier_profile(self.cache, tokens, namespace)
        result = self.cache.match_and_load(tokens, namespace)
        assert result.kv_slots.numel() == result.matched_len
        assert result.matched_len % self.page_size == 0
        assert result.matched_len == device_len + result.num_host_hit + result.num_disk_hit
        assert result.num_host_hit in (0, host_len), "a partial load from host memory"
        if result.num_disk_hit:
            assert result.num_host_hit == host_len, "disk pages loaded past unloaded host pages"
        self.forward_waits()
        self.check_values(namespace, tokens, result.kv_slots)
        return result

    def forward_waits(self) -> None:
        """What a forward does before reading the loaded slots: waits layer by layer."""
        loads = self.cache.controller.layer_loads
        for layer in range(LAYERS):
            loads.wait_layer(layer)
        loads.end_forward()

    def match_prefix(self, tokens, namespace=None) -> MatchResult:
        device_len, _ = tier_profile(self.cache, tokens, namespace)
        host_used = self.host_pool.used_size()
        result = self.cache.match_prefix(tokens, namespace)
        assert result.matched_len == device_len == result.kv_slots.numel()
        assert (result.num_host_hit, result.num_disk_hit) == (0, 0)
        assert self.host_pool.used_size() == host_used, "match_prefix moved KV"
        self.check_values(namespace, tokens, result.kv_slots)
        return result

    def admit(self, tokens, namespace=None, limit: int | None = None) -> Request | None:
        """match_and_load + inc_lock_ref, then slots for the rest (evicting when short) with
        their KV written; None (nothing held) when the device pool cannot hold the rest."""
        tokens = tuple(tokens)
        limit = len(tokens) if limit is None else limit
        match = self.match_and_load(tokens[:limit], namespace)
        self.cache.inc_lock_ref(match.last_node)
        matched = match.matched_len
        num_new = len(tokens) - matched
        ps = self.page_size
        new = self.alloc_for_cache(-(-num_new // ps) * ps) if num_new else torch.empty(0)
        if new is None:
            self.cache.dec_lock_ref(match.last_node)
            return None
        new = new.tolist()
        self.write_values(namespace, tokens, new[:num_new], matched)
        slots = match.kv_slots.tolist() + new[:num_new]
        return Request(tokens, namespace, slots, matched, match.last_node, new[num_new:])

    def insert(self, req: Request) -> None:
        """cache_chunk: the request's KV into the cache, duplicates freed, the lock moved to
        the inserted node."""
        inserted = self.cache.insert(req.tokens, torch.tensor(req.slots), req.namespace)
        num_cacheable = self.cache.cacheable_len(len(req.tokens))
        assert req.num_cached <= inserted.num_present <= num_cacheable
        assert inserted.kv_slots.numel() == num_cacheable
        assert (
            inserted.kv_slots[inserted.num_present :].tolist()
            == req.slots[inserted.num_present : num_cacheable]
        ), "the cache did not take the caller's slots past num_present"
        self.check_values(req.namespace, req.tokens, inserted.kv_slots)
        dups = req.slots[req.num_cached : inserted.num_present]
        self.ledger.free(torch.tensor(dups, dtype=torch.int64))
        req.slots[:num_cacheable] = inserted.kv_slots.tolist()
        self.cache.inc_lock_ref(inserted.last_node)
        self.cache.dec_lock_ref(req.node)
        req.node, req.num_cached, req.is_inserted = inserted.last_node, num_cacheable, True

    def release(self, req: Request, keep_in_cache: bool = True) -> None:
        """The request finishes: its KV into the cache (or not), its own slots freed."""
        if keep_in_cache and not req.is_inserted:
            self.insert(req)
        self.cache.dec_lock_ref(req.node)
        self.ledger.free(torch.tensor(req.own_slots(), dtype=torch.int64))

    def run(self, tokens, namespace=None) -> Request:
        """A whole request: admit, insert, finish; returns it (finished)."""
        req = self.admit(tokens, namespace)
        assert req is not None, "no device memory for the request"
        self.release(req)
        return req

    # --------------------------------------------------------------------------- checks

    def check_all(self, running: list[Request] = ()) -> None:
        """Integrity, values in every tier, and every device and host page owned once."""
        cache = self.cache
        cache.check_integrity()
        tree_pages: list[int] = []
        for namespace, node, prefix in walk_tree(cache):
            start = len(prefix) - len(node.key)
            assert node.kv_slots is not None or node.host_slots is not None, "KV lost"
            parent = node.parent
            if not parent.is_root:  # device nodes, and backed-up nodes, are prefixes
                assert node.kv_slots is None or parent.kv_slots is not None
                assert node.host_slots is None or parent.host_slots is not None
            if node.kv_slots is not None:
                self.check_values(namespace, prefix, node.kv_slots, start)
                tree_pages += self.ledger.pages_of(node.kv_slots)
                assert len(self.ledger.pages_of(node.kv_slots)) * self.page_size == len(node.key)
            if node.host_slots is not None and node.write_op is None:
                exp = expected_kv(namespace, prefix, start, len(prefix))
                assert torch.equal(self.host_rows(node.host_slots), exp), "wrong host copy"
        req_pages = [p for r in running for p in self.ledger.pages_of(r.own_slots())]
        owners = tree_pages + req_pages
        assert len(set(owners)) == len(owners), "a device page has two owners"
        assert set(owners) == self.ledger.outstanding, "a device page leaked"
        assert sum(len(r.own_slots()) for r in running) == len(req_pages) * self.page_size
        ledger_free = self.ledger.available()
        assert ledger_free + cache.total_size() + len(req_pages) * self.page_size == (
            self.ledger.size
        )
        assert cache.check_tiers_idle(), "host pool: held + available != total"
        for req in running:  # locked prefixes stay on the device, at the same slots
            slots = device_slots_of(cache, req.tokens[: req.num_cached], req.namespace)
            assert slots == req.slots[: req.num_cached], "a locked prefix left the device"


# ------------------------------------------------------------------------------ read-only walks


def walk_tree(cache: HiRadixCache):
    """(namespace, node, tokens from the root to the node's end) for every node."""
    for namespace, root in cache._roots.items():
        stack = [(child, child.key) for child in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            yield namespace, node, prefix
            stack += [(c, prefix + c.key) for c in node.children.values()]


def _path(cache: HiRadixCache, tokens, namespace) -> list[tuple[TreeNode, int]]:
    """(node, tokens of it matched) along ``tokens``, without splitting or stamping."""
    tokens = tuple(tokens[: cache.cacheable_len(len(tokens))])
    node = cache._roots.get(namespace)
    out, pos = [], 0
    while node is not None and pos < len(tokens):
        child = node.children.get(child_key(tokens, pos, cache.page_size))
        if child is None:
            break
        num = cache._common_len(child.key, tokens, pos)
        out.append((child, num))
        pos += num
        node = child if num == len(child.key) else None
    return out


def tier_profile(cache: HiRadixCache, tokens, namespace) -> tuple[int, int]:
    """(device part, host-only part after it) of the tree's match of ``tokens``."""
    device = host = 0
    for node, num in _path(cache, tokens, namespace):
        if node.kv_slots is not None and not host:
            device += num
        else:
            assert node.kv_slots is None, "a device node below a host-only one"
            host += num
    return device, host


def device_slots_of(cache: HiRadixCache, tokens, namespace) -> list[int] | None:
    """The device slots the tree holds for all of ``tokens``, or None."""
    out: list[int] = []
    for node, num in _path(cache, tokens, namespace):
        if node.kv_slots is None:
            return None
        out += node.kv_slots[:num].tolist()
    return out if len(out) == len(tokens) else None


def host_only_tokens(cache: HiRadixCache) -> int:
    return sum(len(n.key) for _, n, _ in walk_tree(cache) if n.kv_slots is None)


def node_count(cache: HiRadixCache) -> int:
    return sum(1 for root in cache._roots.values() for _ in iter_subtree(root))


@pytest.fixture
def make_world(tmp_path):
    worlds: list[TieredKV] = []

    def make(page_size=1, num_slots=16, host_tokens=32, policy="write_through", **kwargs):
        world = TieredKV(page_size, num_slots, host_tokens, policy, **kwargs)
        worlds.append(world)
        return world

    yield make
    for world in worlds:
        world.close()


def seq(n: int, base: int = 0) -> tuple[int, ...]:
    return tuple(range(base, base + n))


def spill(world: TieredKV, tokens, namespace=None) -> None:
    """Whatever makes ``world``'s write policy give ``tokens`` a host copy (and, with a disk
    tier, queue their pages for it), then waits for the disk writes."""
    if world.policy == "write_through_selective":
        for _ in range(2):
            world.match_and_load(tokens, namespace)
    elif world.policy == "write_back":
        world.cache.evict(world.num_slots)
    world.flush()


def settle(world: TieredKV) -> None:
    """Waits for the storage threads' reads in flight (the store's own check needs that); the
    host pages of reads that outlived their admission go back at the cache's next step."""
    deadline = time.monotonic() + 10.0
    while world.cache.storage.stats()["pending_reads"] and time.monotonic() < deadline:
        time.sleep(0.01)
    world.cache.tier_stats()  # a step: finished late reads give their host pages back


def slow_prefill(world: TieredKV) -> None:
    """A measured recompute rate that makes every load pay off and disk reads wait long."""
    for _ in range(30):
        world.cache.observe_prefill(10, 10 * SLOW_PREFILL_S_PER_TOKEN)
