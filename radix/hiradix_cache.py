"""HiRadixCache: the radix tree with host-memory and disk tiers under it (HiCache).

Not a second tree: every node of the RadixCache gains a residency. A node's KV is on the
device (``kv_slots``), in the host pool (``host_slots``), or both; its pages may also be on disk,
keyed by a hash chained over the page's ancestors (``page_keys``), and a disk page is found by
key, not by a node, so a restarted server with an empty tree still hits its disk tier.

Residency rules (checked by ``check_integrity``):

* device nodes form a prefix from each root: a node on the device has its parent on the device,
  so a match's device part is one run from the root and ends at a device node;
* backed-up nodes (with a finished host copy) form a prefix from each root too: a node is backed
  up only after its parent; a host-only node therefore has only host-only descendants;
* every device slot and every host slot is held by one node at most; the device counters
  (evictable / protected) count device-resident tokens only, so the scheduler's invariant
  ``available + evictable + protected == max_total_tokens`` is unchanged, and the host pool's
  ``available + held == total`` holds beside it.

Eviction. ``evict(n)`` (device memory) takes unlocked device leaves (nodes with no child on the
device) in LRU order: a backed-up node only drops its device slots and stays in the tree as
host-only; under ``write_back`` (and ``write_through_selective`` with a disk tier) a node is
backed up first; any other node is removed (it has no children then). Eviction never waits for
a copy: freed device slots that a backup still reads (or a load still fills) are handed back
with the compute stream ordered after that copy (``make_stream_wait``), and the node's host
copy counts once its write is done. The host pool evicts on its own when it needs room: host-only leaves with no
locks are removed, and nodes also on the device drop their host copy when no child has one.

Write policies: ``write_through`` backs a node up when it is inserted; ``write_through_selective``
when an admission matches through it for the second time, and, with a disk tier, when it leaves
the device (a conversation's opening churned out by other conversations before its second hit
is kept for a restart);
``write_back`` only when it is evicted from the device. A finished host copy is also queued for
the disk tier, if there is one. ``close`` (a graceful stop) writes what is still only on the
device to the disk tier too, within ``SAVE_ON_CLOSE_S``: a restart is warm for what was served.

Load-back. ``match_and_load`` walks the tree, then follows the chain of page keys on disk past
the tree's end; host and disk pages are brought back into fresh device slots all at once, or not
at all (no device memory, or a load estimated slower than recomputing the same tokens from the
measured copy and prefill rates). The copy is not waited for here: it goes to the KV pool's
``LayerLoads`` and the forward waits for layer ``l`` of it just before layer ``l``'s attention. Disk pages are read by the storage threads (started early by
``prefetch``), verified, put in the host pool as host-only nodes, then loaded like those.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixlm.radix.base import FreeSlotsFn, InsertResult, MatchResult
from radixlm.radix.hicache_stats import TierStats
from radixlm.radix.hiradix_disk import DiskPages, HostPageLender, Read, StagedWrite, last_key
from radixlm.radix.radix_cache import RadixCache
from radixlm.radix.tree_node import TreeNode, child_key

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HOST_EVICT_BATCH = 64  # a host eviction frees at least 1/64 of the host pool
SELECTIVE_HITS = 2  # write_through_selective backs a node up at its second hit
SAVE_ON_CLOSE_S = 3.0  # close() writes device-only prefixes to disk for at most this long
STAGE_HOST_SHARE = 0.25  # at most this share of the host pool holds pages staged to disk
COPY_HIDDEN_SHARE = 0.5  # a step's loads shorter than this share of it hide under its forward
AllocSlotsFn = Callable[[int], "torch.Tensor | None"]


class HiRadixCache(RadixCache):
    """A RadixCache whose nodes spill to a host KV pool and a disk page store.

    ``alloc_slots(n)`` gives ``n`` fresh device slots (whole pages), evicting from this cache
    if needed (it may call ``evict``), or None; ``controller`` copies between the device KV
    buffers and ``controller.host_pool``; ``storage`` is a ``StorageIO`` over a page store (or
    None: no disk tier).
    """

    def __init__(
        self,
        page_size: int,
        free_slots: FreeSlotsFn,
        alloc_slots: AllocSlotsFn,
        controller: Any,
        storage: Any = None,
        write_policy: str = "write_through_selective",
        device: torch.device | str = "cpu",
        prefetch_policy: str = "timeout",
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache write policy must be one of {WRITE_POLICIES}")
        self.controller = controller
        self.host_pool = controller.host_pool
        if self.host_pool.page_size != page_size:
            raise ValueError("the host pool's page size must be the cache's page size")
        self.storage = storage
        self.write_policy = write_policy
        self.prefetch_policy = prefetch_policy  # DiskPages: how admission waits for disk reads
        self._alloc_slots = alloc_slots
        self.stats = TierStats()
        self._pending_writes: list[TreeNode] = []
        self._staged: list[StagedWrite] = []  # pages on their way to disk through the host pool
        # (host slots of one page, its disk read): reads still running when their admission
        # stopped waiting; the page is freed once the read is done
        self._busy_host_pages: list[tuple[torch.Tensor, Any]] = []
        self._loaded_since_prefill = 0  # tokens loaded since the last prefill step
        self.disk: DiskPages | None = None  # reset(), which the base class calls, reads it
        super().__init__(page_size=page_size, free_slots=free_slots, device=device)
        self.disk = self._disk_pages(storage)

    def _disk_pages(self, storage: Any) -> DiskPages | None:
        if storage is None:
            return None
        return DiskPages(
            storage, self.page_size, self.stats, HostPageLender(self), self.prefetch_policy
        )

    # ----------------------------------------------------------------------------- matching

    def match_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> MatchResult:
        path, _ = self._walk(token_ids, namespace)
        return self._device_result(path, self._root(namespace))

    def match_and_load(self, token_ids: Sequence[int], namespace: str | None = None) -> MatchResult:
        self._progress()
        tokens = tuple(token_ids[: self.cacheable_len(len(token_ids))])
        path, pos = self._walk(tokens, namespace)
        for node in path:
            node.hit_count += 1
        on_device = [n for n in path if n.kv_slots is not None]
        num_device = sum(len(n.key) for n in on_device)
        host_nodes = path[len(on_device) :]
        last = path[-1] if path else self._root(namespace)
        disk_nodes, disk_s = self._read_disk(last, tokens, pos, namespace)
        num_host = sum(len(n.key) for n in host_nodes)
        num_disk = sum(len(n.key) for n in disk_nodes)
        loaded = False
        if num_host + num_disk:
            with self.stats.timed("load_back"):
                copy_s = self._load_back(host_nodes + disk_nodes)
            loaded = copy_s is not None
            if loaded and num_disk:  # the disk pages' share of the copy, plus their reads
                disk_s += copy_s * num_disk / (num_host + num_disk)
                self.stats.on_disk_load(num_disk, disk_s)
        if self.write_policy == "write_through_selective":
            for node in path:
                if node.hit_count >= SELECTIVE_HITS and node.kv_slots is not None:
                    self._backup(node)
        self.stats.on_match(len(tokens), num_device, num_host, num_disk, loaded)
        path = path + disk_nodes if loaded else on_device
        result = self._device_result(path, self._root(namespace))
        if not loaded:
            return result
        return MatchResult(
            kv_slots=result.kv_slots,
            matched_len=result.matched_len,
            last_node=result.last_node,
            num_host_hit=num_host,
            num_disk_hit=num_disk,
        )

    def _device_result(self, path: list[TreeNode], root: TreeNode) -> MatchResult:
        """The match's device part: the run of device nodes from the root."""
        on_device = []
        for node in path:
            if node.kv_slots is None:
                break
            on_device.append(node)
        if not on_device:
            return MatchResult(kv_slots=self._concat([]), matched_len=0, last_node=root)
        last = on_device[-1]
        slots = self._concat([n.kv_slots for n in on_device])
        return MatchResult(kv_slots=slots, matched_len=len(slots), last_node=last)

    # ----------------------------------------------------------------------------- inserting

    def insert(
        self, token_ids: Sequence[int], kv_slots: torch.Tensor, namespace: str | None = None
    ) -> InsertResult:
        """As RadixCache.insert; positions the tree holds only in host memory take the
        caller's device slots (they were computed again), so ``num_present`` counts the
        leading device-resident tokens only."""
        if kv_slots.dim() != 1 or kv_slots.numel() != len(token_ids):
            raise ValueError(
                f"insert needs one kv slot per token id: got {len(token_ids)} token ids and "
                f"kv_slots of shape {tuple(kv_slots.shape)}"
            )
        self._progress()
        num_cacheable = self.cacheable_len(len(token_ids))
        path, pos = self._walk(token_ids[:num_cacheable], namespace)
        num_present = 0
        start = 0
        for node in path:
            end = start + len(node.key)
            if node.kv_slots is None:
                self._adopt(node, kv_slots[start:end])
            elif num_present == start:
                num_present = end
            start = end
        node = path[-1] if path else self._root(namespace)
        if pos < num_cacheable:
            leaf = self._add_leaf(node, tuple(token_ids[pos:num_cacheable]), kv_slots[pos:])
            self._set_page_keys(leaf, namespace)
            path.append(leaf)
            if self.write_policy == "write_through":
                if self.disk is not None and not (node.is_root or node.host_slots is not None):
                    self._stage_to_disk(leaf)
                else:
                    self._backup(leaf)
        slots = self._concat([n.kv_slots for n in path])
        return InsertResult(num_present, slots, path[-1] if path else node)

    def _adopt(self, node: TreeNode, kv_slots: torch.Tensor) -> None:
        """A host-only node takes freshly computed device slots: it is on both tiers now."""
        node.kv_slots = kv_slots.to(device=self.device, dtype=torch.int64).clone()
        self._count_device(node, +1)

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], kv_slots: torch.Tensor) -> TreeNode:
        return super()._add_leaf(parent, key, kv_slots[: len(key)])

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Cuts ``node`` after ``split_len`` tokens (on every tier it is on); returns the upper
        half, which keeps the lock count, hits, clock and any unfinished copy."""
        parent = node.parent
        assert parent is not None and 0 < split_len < len(node.key)
        upper = TreeNode(
            key=node.key[:split_len],
            kv_slots=None if node.kv_slots is None else node.kv_slots[:split_len],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access_time=node.last_access_time,
        )
        upper.hit_count = node.hit_count
        parent.children[child_key(node.key, 0, self.page_size)] = upper
        node.key = node.key[split_len:]
        if node.kv_slots is not None:
            node.kv_slots = node.kv_slots[split_len:]
        if node.host_slots is not None:
            upper.host_slots = node.host_slots[:split_len]
            node.host_slots = node.host_slots[split_len:]
        if node.page_keys is not None:
            num_pages = split_len // self.page_size
            upper.page_keys = node.page_keys[:num_pages]
            node.page_keys = node.page_keys[num_pages:]
        upper.load_op = node.load_op
        if node.write_op is not None:
            upper.write_op = node.write_op
            self._pending_writes.append(upper)
        node.parent = upper
        upper.children[child_key(node.key, 0, self.page_size)] = node
        return upper

    # ----------------------------------------------------------------------------- locks, counts

    @staticmethod
    def _counts_tokens(node: TreeNode) -> bool:
        return node.kv_slots is not None  # the counters are the device pool's

    def _count_device(self, node: TreeNode, sign: int) -> None:
        if node.lock_ref:
            self._protected_tokens += sign * len(node.key)
        else:
            self._evictable_tokens += sign * len(node.key)

    # ----------------------------------------------------------------------------- eviction

    def evict(self, num_tokens: int) -> int:
        self._progress()
        heap = [(n.last_access_time, n.node_id, n) for n in self._all_nodes() if self._dev_leaf(n)]
        heapq.heapify(heap)
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._dev_leaf(node):
                continue
            parent = node.parent
            if node.host_slots is None and self._keeps_on_evict(node):
                self._backup(node)
            num_freed += len(node.key)
            if node.host_slots is not None:
                self._drop_device(node)
            else:
                self._remove_leaf(node)
            if parent is not None and self._dev_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        self._drop_empty_namespaces()
        return num_freed

    def _keeps_on_evict(self, node: TreeNode) -> bool:
        """Whether a node leaving the device without a host copy gets one first."""
        if self.write_policy == "write_back":
            return True
        return self.write_policy == "write_through_selective" and self.disk is not None

    def _dev_leaf(self, node: TreeNode) -> bool:
        """An unlocked device node without children on the device: the next to leave it."""
        if node.is_root or node.kv_slots is None or node.lock_ref:
            return False
        return all(c.kv_slots is None for c in node.children.values())

    def _free_device(self, node: TreeNode) -> None:
        """Gives the node's device slots back; later device work that reuses them is ordered
        after the copies still filling or reading them (no CPU wait on CUDA)."""
        for op in (node.load_op, node.write_op):
            if op is not None and not op.done():
                op.make_stream_wait()
        node.load_op = None
        self._count_device(node, -1)
        self._free_slots(node.kv_slots)

    def _drop_device(self, node: TreeNode) -> None:
        self._free_device(node)
        node.kv_slots = None
        self.stats.device_evicted_to_host += len(node.key)

    def _remove_leaf(self, node: TreeNode) -> int:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[child_key(node.key, 0, self.page_size)]
        if node.kv_slots is not None:
            self._free_device(node)
        if node.host_slots is not None:
            self.host_pool.free(node.host_slots)
        return len(node.key)

    def _evict_host(self, num_tokens: int, keep: set[int]) -> int:
        """Frees host slots: host-only leaves are removed, device nodes drop their host copy
        (never one whose child has a host copy, never a node in ``keep``), LRU first."""
        heap = [(n.last_access_time, n.node_id, n) for n in self._all_nodes() if self._host_leaf(n)]
        heapq.heapify(heap)
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if id(node) in keep or not self._host_leaf(node):
                continue
            parent = node.parent
            num_freed += len(node.key)
            if node.kv_slots is None:
                self._remove_leaf(node)
            else:
                self.host_pool.free(node.host_slots)
                node.host_slots = None
            if parent is not None and self._host_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        return num_freed

    def _host_leaf(self, node: TreeNode) -> bool:
        if node.is_root or node.host_slots is None or node.write_op is not None:
            return False
        if node.load_op is not None and not node.load_op.done():
            return False  # a load still reads its host pages
        if node.kv_slots is None and node.lock_ref:
            return False
        return all(c.host_slots is None for c in node.children.values())

    def _alloc_host(self, num_tokens: int, keep: set[int]) -> torch.Tensor | None:
        slots = self.host_pool.alloc(num_tokens)
        if slots is None:  # evict a batch: each eviction pass walks the whole tree
            short = num_tokens - self.host_pool.available_size()
            self._evict_host(max(short, self.host_pool.total_size() // HOST_EVICT_BATCH), keep)
            slots = self.host_pool.alloc(num_tokens)
        return slots

    # ----------------------------------------------------------------------------- write-back

    def _backup(self, node: TreeNode) -> bool:
        """Gives ``node`` (and first any ancestor without one) a host copy; False when the
        host pool has no room."""
        if node.host_slots is not None:
            return True
        with self.stats.timed("backup"):
            return self._backup_chain(node)

    def _backup_chain(self, node: TreeNode) -> bool:
        chain = []
        cur = node
        while not cur.is_root and cur.host_slots is None:
            chain.append(cur)
            cur = cur.parent  # type: ignore[assignment]
        keep = {id(n) for n in chain} | {id(p) for p in self._ancestors(node)}
        for cur in reversed(chain):
            host = self._alloc_host(len(cur.key), keep)
            if host is None:
                self.stats.backups_skipped += 1
                return False
            cur.host_slots = host
            cur.write_op = self.controller.write_back(cur.kv_slots, host)
            self.stats.write_back_tokens += len(cur.key)
            self._pending_writes.append(cur)
        self._progress()
        return True

    def _ancestors(self, node: TreeNode):
        while not node.is_root:
            yield node
            node = node.parent  # type: ignore[assignment]

    def _progress(self) -> None:
        """Folds finished device -> host copies in (those nodes' pages go to the disk tier) and
        frees the host pages of finished late disk reads."""
        self._free_finished_reads()
        self._progress_staged()
        if not self._pending_writes:
            return
        still = []
        for node in self._pending_writes:
            if node.write_op is not None and not self._finish_write(node, wait=False):
                still.append(node)
        self._pending_writes = still

    def _finish_write(self, node: TreeNode, wait: bool) -> bool:
        op = node.write_op
        if not wait and not op.done():
            return False
        op.wait()
        node.write_op = None
        self._store_pages(node)
        return True

    def _store_pages(self, node: TreeNode) -> None:
        if self.disk is None or node.page_keys is None or node.host_slots is None:
            return
        with self.stats.timed("store_pages"):
            self.disk.queue_writes(node, self.host_pool)

    def _stage_to_disk(self, node: TreeNode) -> None:
        """Write-through of a leaf whose parent has no host copy (a host pool smaller than the
        device pool dropped it), with a disk tier: the leaf's pages go to disk through host
        pages it does not keep, freed once the writer is done with them. Backing the leaf up
        would first copy every ancestor back into the host pool (the whole conversation again,
        every turn) only to keep the host copies a prefix; the disk's chained keys need no
        parent in memory. The device slots wait for the copy as a backup's do (``write_op``)."""
        keys = node.page_keys or []
        if not any(not self.disk.storage.exists(k) for k in keys):
            return
        staged = sum(len(s.key) for s in self._staged)
        if staged + len(node.key) > STAGE_HOST_SHARE * self.host_pool.total_size():
            self.stats.disk_writes_skipped += len(keys)  # best effort: reads need the room
            return
        with self.stats.timed("backup"):
            host = self._alloc_host(len(node.key), {id(n) for n in self._ancestors(node)})
            if host is None:
                self.stats.backups_skipped += 1
                return
            op = self.controller.write_back(node.kv_slots, host)
            self.stats.write_back_tokens += len(node.key)
            node.write_op = op
            self._pending_writes.append(node)  # clears write_op once done (no host copy kept)
            self._staged.append(StagedWrite(node.key, list(keys), host, op))

    def _progress_staged(self) -> None:
        """Staged pages whose copy is done go to the disk writer; their host pages are freed
        once the writer has none of them left (written, dropped or skipped)."""
        if not self._staged:
            return
        still = []
        for staged in self._staged:
            if not staged.queued:
                if not staged.op.done():
                    still.append(staged)
                    continue
                staged.op.wait()
                with self.stats.timed("store_pages"):
                    self.disk.queue_pages(staged.keys, staged.key, staged.host, self.host_pool)
                staged.queued = True
            if self.disk.storage.any_pending(staged.keys):
                still.append(staged)
            else:
                self.host_pool.free(staged.host)
        self._staged = still

    def _free_staged(self) -> None:
        """Frees every staged page (a write still queued from one finds it freed and skips it:
        its generation tells)."""
        for staged in self._staged:
            staged.op.wait()
            self.host_pool.free(staged.host)
        self._staged = []

    # ----------------------------------------------------------------------------- disk tier

    def _set_page_keys(self, node: TreeNode, namespace: str | None) -> None:
        if self.disk is not None:
            node.page_keys = self.disk.keys_after(last_key(node.parent), namespace, node.key)

    def prefetch(self, token_ids: Sequence[int], namespace: str | None = None) -> Any:
        if self.disk is None:
            return None
        tokens = tuple(token_ids[: self.cacheable_len(len(token_ids))])
        node, pos = self._peek(tokens, namespace)
        return self.disk.prefetch(last_key(node), namespace, tokens, pos) or None

    def prefetch_ready(self, handle: Any, waited_s: float) -> bool:
        if self.disk is None or handle is None:
            return True
        return self.disk.ready(handle, waited_s)

    def release_prefetch(self, handle: Any) -> None:
        if self.disk is not None and handle:
            self.disk.release(handle)

    def _peek(self, tokens: tuple[int, ...], namespace: str | None) -> tuple[TreeNode, int]:
        """The deepest node whose whole key matches ``tokens`` (no split, no clock)."""
        node = self._roots.get(namespace) or self._new_root()
        pos = 0
        while pos < len(tokens):
            child = node.children.get(child_key(tokens, pos, self.page_size))
            if child is None or self._common_len(child.key, tokens, pos) < len(child.key):
                break
            pos += len(child.key)
            node = child
        return node, pos

    def _read_disk(
        self, last: TreeNode, tokens: tuple[int, ...], pos: int, namespace: str | None
    ) -> tuple[list[TreeNode], float]:
        """Pages past the tree's end found on disk, as new host-only nodes under ``last``, and
        the seconds their reads took (what a disk hit costs, without the parent's backup)."""
        if self.disk is None or pos >= len(tokens):
            return [], 0.0
        if not last.is_root and last.page_keys is None:
            return [], 0.0
        keys, pages = self.disk.find(last_key(last), namespace, tokens, pos)
        if not keys:
            return [], 0.0
        num_tokens = len(keys) * self.page_size
        if not self.stats.disk_pays_off(
            num_tokens, self.controller.bytes_per_token, self.controller.estimate_load_seconds
        ):
            self.stats.loads_skipped_slower += 1
            return [], 0.0
        # a host-only child needs a parent with a host copy: backed up only for a disk hit
        # (before, every admission past the tree's end copied its whole device prefix to the
        # host pool, and a small host pool evicted and re-wrote pages for nothing)
        if not last.is_root and not self._backup(last):
            return [], 0.0
        started = time.perf_counter()
        with self.stats.timed("disk_wait"):
            nodes = self._disk_to_host(last, keys, pages)
        return nodes, time.perf_counter() - started

    def _disk_to_host(
        self, last: TreeNode, keys: list[bytes], pages: list[tuple[int, ...]]
    ) -> list[TreeNode]:
        """Reads the run into host pages: those its reads ahead hold, and pages reserved now
        for the rest. The leading pages read become a host-only node under ``last``; the other
        pages are given back (once their read is done: ``_busy_host_pages``)."""
        reads = self.disk.take_reads(keys)
        need = [i for i, r in enumerate(reads) if r is None or r.page_id is None]
        host = self._alloc_host(len(need) * self.page_size, {id(n) for n in self._ancestors(last)})
        if host is None:
            for read in reads:
                if read is not None:
                    read.future.cancel()
                    self._give_back_page(read.page_id, read.future)
            return []
        for i, page_id in zip(need, self.host_pool.page_ids(host).tolist(), strict=True):
            reads[i] = Read(None if reads[i] is None else reads[i].future, page_id)
        num_read, rest = self.disk.read_into(keys, pages, reads, self.host_pool)
        for read in rest:
            self._give_back_page(read.page_id, read.future)
        if not num_read:
            return []
        key = tuple(t for page in pages[:num_read] for t in page)
        node = TreeNode(key=key, kv_slots=None, parent=last, last_access_time=self._clock)
        node.host_slots = torch.cat([self._page_slots(r.page_id) for r in reads[:num_read]])
        node.page_keys = keys[:num_read]
        last.children[child_key(key, 0, self.page_size)] = node
        return [node]

    def _give_back_page(self, page_id: int | None, future: Any) -> None:
        """A host page a disk read used: free now, or once the read running into it is done."""
        if page_id is None:
            return
        if future is None or future.done():
            self._free_host_pages([page_id])
        else:
            self._busy_host_pages.append((self._page_slots(page_id), future))

    def _wait_busy_reads(self) -> None:
        """Waits for the disk reads still running into host pages whose admission stopped
        waiting (a cancelled read is done at once) and frees their pages: nothing is left held
        by the tier after :meth:`reset`."""
        busy, self._busy_host_pages = self._busy_host_pages, []
        for slots, fut in busy:
            if not fut.cancelled():
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 - a failed read still gives its page back
                    pass
            self.host_pool.free(slots)

    def _page_slots(self, page_id: int) -> torch.Tensor:
        ps = self.page_size
        return torch.arange(page_id * ps, (page_id + 1) * ps, dtype=torch.int64)

    def _free_host_pages(self, page_ids: list[int]) -> None:
        if page_ids:
            self.host_pool.free(torch.cat([self._page_slots(p) for p in page_ids]))

    def _free_finished_reads(self) -> None:
        """Host pages whose disk read outlived its admission go back once the read is done."""
        if self._busy_host_pages:
            busy = self._busy_host_pages
            self._busy_host_pages = [(s, f) for s, f in busy if not f.done()]
            for slots, fut in busy:
                if fut.done():
                    self.host_pool.free(slots)

    # ----------------------------------------------------------------------------- load-back

    def _load_back(self, nodes: list[TreeNode]) -> float | None:
        """Loads host-only ``nodes`` (a chain) into fresh device slots, all or nothing; the
        seconds the copy took to issue (to run, for a synchronous copy), None if not loaded.
        The device slots' allocation (and the evictions and backups it may cause) is left out:
        recomputing needs the same slots."""
        num_tokens = sum(len(n.key) for n in nodes)
        if not self.stats.load_pays_off(num_tokens, self.controller.estimate_load_seconds):
            self.stats.loads_skipped_slower += 1
            return None
        self.inc_lock_ref(nodes[-1])  # host nodes and the device path: nothing evicts them
        try:
            device_slots = self._alloc_slots(num_tokens)
        finally:
            self.dec_lock_ref(nodes[-1])
        if device_slots is None:
            self.stats.loads_skipped_no_memory += 1
            return None
        started = time.perf_counter()
        host_slots = torch.cat([n.host_slots for n in nodes])
        op = self.controller.load_back(host_slots, device_slots)
        self.controller.layer_loads.add(op)  # the forward waits for it layer by layer
        start = 0
        for node in nodes:
            node.load_op = op
            node.kv_slots = device_slots[start : start + len(node.key)].to(torch.int64)
            start += len(node.key)
            self._count_device(node, +1)
        self.stats.load_back_tokens += num_tokens
        self._loaded_since_prefill += num_tokens
        return time.perf_counter() - started

    # ----------------------------------------------------------------------------- prefill rate

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Measures the recompute rate. The copies of loads admitted with this step run under
        its forward, layer by layer (on a CPU they ran at admission, before the step): a step
        whose copies are estimated shorter than ``COPY_HIDDEN_SHARE`` of it counts as compute
        as it is; a step the copies may dominate teaches nothing."""
        loaded, self._loaded_since_prefill = self._loaded_since_prefill, 0
        if loaded and self.controller.estimate_load_seconds(loaded) >= COPY_HIDDEN_SHARE * seconds:
            return
        self.stats.on_prefill(num_tokens, seconds)

    # ----------------------------------------------------------------------------- whole cache

    def reset(self) -> None:
        """Frees both tiers (the disk tier is kept: it is what a restart starts warm from)."""
        if self._protected_tokens:
            raise RuntimeError(
                f"reset() while {self._protected_tokens} tokens are locked by running requests"
            )
        self.controller.layer_loads.wait_all()
        for node in list(self._all_nodes()):
            if node.write_op is not None:
                node.write_op.wait()
            if node.kv_slots is not None:
                self._free_slots(node.kv_slots)
            if node.host_slots is not None:
                self.host_pool.free(node.host_slots)
        self._pending_writes = []
        self._free_staged()
        if self.disk is not None:
            self.disk.forget_reads()
        self._wait_busy_reads()
        self._roots = {None: self._new_root()}
        self._evictable_tokens = 0

    def replace_storage(self, storage: Any) -> None:
        """Another disk page store (the model's weights changed: pages of the old ones must
        neither be read nor written to any more); only on an emptied cache (:meth:`reset`)."""
        if self._evictable_tokens or self._protected_tokens or self._pending_writes:
            raise RuntimeError("replace_storage() needs an empty cache: reset() it first")
        if self.disk is not None:
            self.disk.close()  # flushes the queued writes of the old weights' pages
        self.storage = storage
        self.disk = self._disk_pages(storage)

    def close(self, save_s: float = SAVE_ON_CLOSE_S) -> None:
        """Finishes the copies in flight; with a disk tier, first writes the prefixes only the
        device holds to disk (parents first, for at most ``save_s``), then flushes the writer."""
        self._finish_pending_writes()
        if self.disk is not None:
            for staged in self._staged:  # every staged copy is done: queue them all
                staged.op.wait()
            self._progress_staged()
            self._save_device_only(time.monotonic() + save_s)
            self.disk.close()
            self._free_staged()

    def _finish_pending_writes(self) -> None:
        self._progress()
        for node in self._pending_writes:
            if node.write_op is not None:
                self._finish_write(node, wait=True)
        self._pending_writes = []

    def _save_device_only(self, deadline: float) -> None:
        """Device nodes without a host copy are backed up and their pages queued for the disk
        writer, which is drained whenever the host pool or the write queue would otherwise
        drop a queued page; stops at ``deadline``."""
        storage = self.disk.storage
        bytes_per_token = self.host_pool.bytes_per_token
        for node in self._parents_first():
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("hicache: stopped saving device-only prefixes to disk in time")
                return
            if node.kv_slots is None or node.host_slots is not None or node.page_keys is None:
                continue
            if not any(not storage.exists(k) for k in node.page_keys):
                continue  # on disk already (staged there, or written before a host eviction)
            num_bytes = len(node.key) * bytes_per_token
            queue_full = storage.pending_write_bytes() + num_bytes > storage.max_pending_write_bytes
            if queue_full or self.host_pool.available_size() < len(node.key):
                storage.flush(left)  # host pages about to be reused are on disk first
            if self._backup(node):
                self._finish_pending_writes()

    def _parents_first(self) -> list[TreeNode]:
        out = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def tier_stats(self) -> dict[str, Any]:
        self._progress()
        info = self.stats.as_dict()
        info.update(
            write_policy=self.write_policy,
            host_total_tokens=self.host_pool.total_size(),
            host_used_tokens=self.host_pool.used_size(),
            host_available_tokens=self.host_pool.available_size(),
            **{f"copy_{k}": v for k, v in self.controller.stats().items()},
        )
        if self.storage is not None:
            info.update({f"disk_{k}": v for k, v in self.storage.stats().items()})
        if self.disk is not None:
            info["disk_prefetched_pages"] = self.disk.num_prefetched
        return info

    def host_held_tokens(self) -> int:
        """Host tokens held by nodes, by reads ahead of admission, and by disk reads still
        running into given-up pages."""
        held = sum(len(n.key) for n in self._all_nodes() if n.host_slots is not None)
        held += sum(len(s.key) for s in self._staged)
        num_reserved = 0 if self.disk is None else self.disk.num_reserved
        return held + (len(self._busy_host_pages) + num_reserved) * self.page_size

    def check_tiers_idle(self) -> bool:
        held = self.host_held_tokens()
        ok = held + self.host_pool.available_size() == self.host_pool.total_size()
        if not ok:
            logger.error(
                "host KV leak: held %d + available %d != total %d",
                held,
                self.host_pool.available_size(),
                self.host_pool.total_size(),
            )
        return ok

    # ----------------------------------------------------------------------------- checks

    def check_integrity(self) -> None:
        from radixlm.radix.hiradix_checks import check_hiradix

        check_hiradix(self)

    @staticmethod
    def _where(node: TreeNode, more: str) -> str:
        device = "device" if node.kv_slots is not None else ""
        host = "host" if node.host_slots is not None else ""
        return f"on={'+'.join(t for t in (device, host) if t)} hits={node.hit_count}"

    def snapshot(self):  # the plain tree's snapshot reads device slots of every node
        raise NotImplementedError("HiRadixCache has no snapshot; use format_tree")
