"""Nodes of the radix tree and the structural checks over them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# A child is found by its first token (page_size 1) or by the tuple of its first page's tokens.
ChildKey = int | tuple[int, ...]

_node_ids = itertools.count()


@dataclass(eq=False)
class TreeNode:
    """One edge of the radix tree: a run of tokens and the KV slots that hold them.

    A root has ``parent is None``, an empty key and is never locked or evicted.
    """

    key: tuple[int, ...]  # token ids on the edge into this node; len is a multiple of page_size
    kv_slots: torch.Tensor  # [len(key)] int64 on the cache's device
    parent: TreeNode | None
    children: dict[ChildKey, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0  # number of requests holding this node (or a descendant)
    last_access_time: int = 0  # logical clock of the last match/insert that passed here
    node_id: int = field(default_factory=lambda: next(_node_ids))  # tie-break for the LRU heap
    # HiCache residency (unused by the plain RadixCache). A node is on the device when
    # ``kv_slots`` is not None, in host memory when ``host_slots`` is not None, or both.
    host_slots: torch.Tensor | None = None  # [len(key)] int64 CPU: slots of the host KV pool
    page_keys: list[bytes] | None = None  # disk keys of the node's pages (chained hashes)
    hit_count: int = 0  # admissions that matched through this node
    write_op: Any = None  # an unfinished device -> host copy of this node (CopyOp), or None
    load_op: Any = None  # the host -> device copy that filled ``kv_slots`` (CopyOp), or None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)})"
        )

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_evictable_leaf(self) -> bool:
        return not self.is_root and not self.children and self.lock_ref == 0


def child_key(tokens: tuple[int, ...], start: int, page_size: int) -> ChildKey:
    """The children-dict key for the edge starting at ``tokens[start]``."""
    if page_size == 1:
        return tokens[start]
    return tokens[start : start + page_size]


def iter_subtree(root: TreeNode) -> Iterator[TreeNode]:
    """Every node below ``root`` (excluded), parents before children."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def check_node(node: TreeNode, page_size: int) -> None:
    """Assert the local invariants of one non-root node."""
    parent = node.parent
    assert parent is not None, "a non-root node lost its parent"
    assert len(node.key) > 0, f"empty non-root node {node.node_id}"
    assert len(node.key) % page_size == 0, f"node {node.node_id} is not page-aligned"
    assert node.kv_slots.dtype == torch.int64 and node.kv_slots.dim() == 1
    assert node.kv_slots.numel() == len(node.key), f"node {node.node_id}: slots != tokens"
    key = child_key(node.key, 0, page_size)
    assert parent.children.get(key) is node, f"node {node.node_id} is filed under a wrong key"
    assert node.lock_ref >= 0, f"node {node.node_id} has a negative lock_ref"
    if not parent.is_root:
        assert parent.lock_ref >= node.lock_ref, f"node {node.node_id} locked more than parent"
        assert parent.last_access_time >= node.last_access_time, "child newer than its parent"


def check_root(root: TreeNode) -> None:
    assert root.parent is None and len(root.key) == 0 and root.kv_slots.numel() == 0
    assert root.lock_ref == 0, "a root was locked"
