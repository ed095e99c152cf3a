"""The invariants of a HiRadixCache, residency included (see hiradix_cache's docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.hicache.page_hash import page_key
from radixlm.radix.tree_node import TreeNode, check_root, child_key, iter_subtree

if TYPE_CHECKING:
    from radixlm.radix.hiradix_cache import HiRadixCache


def check_hiradix(cache: HiRadixCache) -> None:
    """Asserts structure, residency, counters and that every slot of each tier is held once."""
    evictable = protected = host_held = 0
    device_slots: list[torch.Tensor] = []
    host_slots: list[torch.Tensor] = []
    for namespace, root in cache._roots.items():
        check_root(root)
        for node in iter_subtree(root):
            _check_node(cache, node, namespace)
            if node.kv_slots is not None:
                device_slots.append(node.kv_slots)
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
            if node.host_slots is not None:
                host_slots.append(node.host_slots)
                host_held += len(node.key)
    assert evictable == cache._evictable_tokens, f"{evictable=} != {cache._evictable_tokens}"
    assert protected == cache._protected_tokens, f"{protected=} != {cache._protected_tokens}"
    dev = cache._concat(device_slots)
    assert dev.unique().numel() == dev.numel(), "a device slot is held by two tree positions"
    for staged in cache._staged:  # pages on their way to disk, held by no node
        host_slots.append(staged.host)
        host_held += len(staged.key)
    for slots, _ in cache._busy_host_pages:  # late disk reads: held until they are done
        host_slots.append(slots)
        host_held += len(slots)
    if cache.disk is not None:  # pages lent to reads ahead of admission
        assert cache.disk.num_reserved == len(cache.disk.reserved_page_ids())
        for page_id in cache.disk.reserved_page_ids():
            host_slots.append(cache._page_slots(page_id))
            host_held += cache.page_size
    host = torch.cat(host_slots) if host_slots else torch.empty(0, dtype=torch.int64)
    assert host.unique().numel() == host.numel(), "a host slot is held by two tree positions"
    pool = cache.host_pool
    assert host_held == pool.used_size(), f"host pool uses {pool.used_size()}, tree {host_held}"
    pool.check_integrity()
    if cache.storage is not None:
        cache.storage.store.check_integrity()


def _check_node(cache: HiRadixCache, node: TreeNode, namespace: str | None) -> None:
    ps = cache.page_size
    parent = node.parent
    assert parent is not None, "a non-root node lost its parent"
    assert len(node.key) > 0 and len(node.key) % ps == 0, f"node {node.node_id}: bad key length"
    assert parent.children.get(child_key(node.key, 0, ps)) is node, "node filed under a wrong key"
    assert node.kv_slots is not None or node.host_slots is not None, "node on no tier"
    for slots in (node.kv_slots, node.host_slots):
        if slots is not None:
            assert slots.dtype == torch.int64 and slots.numel() == len(node.key)
    assert node.lock_ref >= 0
    if not parent.is_root:
        assert parent.lock_ref >= node.lock_ref, f"node {node.node_id} locked more than parent"
        assert parent.last_access_time >= node.last_access_time, "child newer than its parent"
        if node.kv_slots is not None:
            assert parent.kv_slots is not None, "device nodes must form a prefix from the root"
        if node.host_slots is not None:
            assert parent.host_slots is not None, "backed-up nodes must form a prefix"
    if node.kv_slots is None:
        assert node.lock_ref == 0, f"host-only node {node.node_id} is locked"
        if node.write_op is not None:  # evicted while its backup was in flight
            pending = cache._pending_writes
            assert any(n is node for n in pending), "an unfinished write nobody waits for"
    if cache.storage is not None:
        _check_page_keys(node, namespace, ps)


def _check_page_keys(node: TreeNode, namespace: str | None, page_size: int) -> None:
    assert node.page_keys is not None and len(node.page_keys) == len(node.key) // page_size
    parent = node.parent
    prev = parent.page_keys[-1] if parent is not None and parent.page_keys else None
    for i, key in enumerate(node.page_keys):
        prev = page_key(prev, namespace, node.key[i * page_size : (i + 1) * page_size])
        assert key == prev, f"node {node.node_id}: page key {i} does not chain"
