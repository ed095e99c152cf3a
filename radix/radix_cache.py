"""RadixCache: a radix tree over token ids whose nodes own KV slots (RadixAttention)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from radixlm.radix.base import FreeSlotsFn, InsertResult, MatchResult, PrefixCache
from radixlm.radix.tree_node import TreeNode, check_node, check_root, child_key, iter_subtree

_MAX_TOKENS_SHOWN = 8


class RadixCache(PrefixCache):
    """Prefix cache backed by a radix tree; one tree root per namespace.

    Edges hold whole pages; children are keyed by their first token (page_size 1) or by the
    tuple of their first page. Matching or inserting stamps the visited nodes with a logical
    clock, so a parent is never older than its children and evicting unlocked leaves in clock
    order evicts the least recently used tokens first.
    """

    def __init__(
        self,
        page_size: int = 1,
        free_slots: FreeSlotsFn | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if free_slots is None:
            raise ValueError("RadixCache needs free_slots, the callback that frees KV slots")
        self.page_size = page_size
        self.device = torch.device(device)
        self._free_slots = free_slots
        self._roots: dict[str | None, TreeNode] = {}
        self._clock = 0
        self._evictable_tokens = 0
        self._protected_tokens = 0
        self.reset()

    # ----------------------------------------------------------------------------- queries

    def cacheable_len(self, num_tokens: int) -> int:
        return num_tokens // self.page_size * self.page_size

    def evictable_size(self) -> int:
        return self._evictable_tokens

    def protected_size(self) -> int:
        return self._protected_tokens

    def match_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> MatchResult:
        path, pos = self._walk(token_ids, namespace)
        node = path[-1] if path else self._root(namespace)
        pieces = [n.kv_slots for n in path]
        return MatchResult(kv_slots=self._concat(pieces), matched_len=pos, last_node=node)

    def _walk(self, token_ids: Sequence[int], namespace: str | None) -> tuple[list[TreeNode], int]:
        """The nodes matching the page-aligned part of ``token_ids`` from the root, the last
        one split where the match ends inside it, stamped with the clock; and the match length."""
        tokens = tuple(token_ids[: self.cacheable_len(len(token_ids))])
        self._clock += 1
        node = self._root(namespace)
        path: list[TreeNode] = []
        pos = 0
        while pos < len(tokens):
            child = node.children.get(child_key(tokens, pos, self.page_size))
            if child is None:
                break
            num_common = self._common_len(child.key, tokens, pos)
            if num_common < len(child.key):
                child = self._split(child, num_common)
            child.last_access_time = self._clock
            path.append(child)
            pos += num_common
            node = child
        return path, pos

    def continuation(
        self, token_ids: Sequence[int], max_tokens: int, namespace: str | None = None
    ) -> list[int]:
        # Whole edges are compared as slices (C speed); the Python work is one step per node.
        root = self._roots.get(namespace)
        if root is None or max_tokens <= 0 or not token_ids:
            return []
        node, pos, num = root, 0, len(token_ids)
        out: list[int] = []
        while pos < num:
            child = self._child_along(node, token_ids, pos)
            if child is None:
                return []
            size = min(len(child.key), num - pos)
            if child.key[:size] != tuple(token_ids[pos : pos + size]):
                return []
            out = list(child.key[size:])  # non-empty only where the query ends inside an edge
            pos += size
            node = child
        while len(out) < max_tokens and node.children:
            node = max(node.children.values(), key=lambda n: (n.last_access_time, n.node_id))
            out += node.key
        return out[:max_tokens]

    def _child_along(self, node: TreeNode, token_ids: Sequence[int], pos: int) -> TreeNode | None:
        """The child of ``node`` whose edge starts with ``token_ids[pos:]`` (a query ending
        inside a child's first page: the most recently used such child), without changes."""
        if len(token_ids) - pos >= self.page_size:
            return node.children.get(
                child_key(tuple(token_ids[pos : pos + self.page_size]), 0, self.page_size)
            )
        rest = tuple(token_ids[pos:])
        found = [c for c in node.children.values() if c.key[: len(rest)] == rest]
        return max(found, key=lambda n: (n.last_access_time, n.node_id), default=None)

    # ----------------------------------------------------------------------------- updates

    def insert(
        self, token_ids: Sequence[int], kv_slots: torch.Tensor, namespace: str | None = None
    ) -> InsertResult:
        if kv_slots.dim() != 1 or kv_slots.numel() != len(token_ids):
            raise ValueError(
                f"insert needs one kv slot per token id: got {len(token_ids)} token ids and "
                f"kv_slots of shape {tuple(kv_slots.shape)}"
            )
        num_cacheable = self.cacheable_len(len(token_ids))
        tokens = tuple(token_ids[:num_cacheable])
        self._clock += 1
        node = self._root(namespace)
        pieces: list[torch.Tensor] = []
        pos = num_present = 0
        while pos < num_cacheable:
            child = node.children.get(child_key(tokens, pos, self.page_size))
            if child is None:
                num_present = pos
                node = self._add_leaf(node, tokens[pos:], kv_slots[pos:num_cacheable])
                pieces.append(node.kv_slots)
                break
            num_common = self._common_len(child.key, tokens, pos)
            if num_common < len(child.key):
                child = self._split(child, num_common)
            child.last_access_time = self._clock
            pieces.append(child.kv_slots)
            pos += num_common
            node = child
        else:
            num_present = pos
        return InsertResult(num_present, self._concat(pieces), node)

    def inc_lock_ref(self, node: TreeNode) -> None:
        while not node.is_root:
            if node.lock_ref == 0 and self._counts_tokens(node):
                self._evictable_tokens -= len(node.key)
                self._protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        while not node.is_root:
            assert node.lock_ref > 0, f"dec_lock_ref on unlocked node {node.node_id}"
            if node.lock_ref == 1 and self._counts_tokens(node):
                self._protected_tokens -= len(node.key)
                self._evictable_tokens += len(node.key)
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    @staticmethod
    def _counts_tokens(node: TreeNode) -> bool:
        """Whether the node's tokens count in evictable / protected (a tiered cache counts
        device-resident nodes only)."""
        return True

    def evict(self, num_tokens: int) -> int:
        heap = [
            (n.last_access_time, n.node_id, n) for n in self._all_nodes() if n.is_evictable_leaf
        ]
        heapq.heapify(heap)
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            num_freed += self._remove_leaf(node)
            if parent is not None and parent.is_evictable_leaf:
                heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        self._drop_empty_namespaces()
        return num_freed

    def reset(self) -> None:
        if self._protected_tokens:
            raise RuntimeError(
                f"reset() while {self._protected_tokens} tokens are locked by running requests"
            )
        for node in list(self._all_nodes()):
            self._free_slots(node.kv_slots)
        self._roots = {None: self._new_root()}
        self._evictable_tokens = 0

    # ----------------------------------------------------------------------------- checks

    def check_integrity(self) -> None:
        evictable = protected = 0
        held: list[torch.Tensor] = []
        for root in self._roots.values():
            check_root(root)
            for node in iter_subtree(root):
                check_node(node, self.page_size)
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                held.append(node.kv_slots)
        assert evictable == self._evictable_tokens, f"{evictable=} != {self._evictable_tokens}"
        assert protected == self._protected_tokens, f"{protected=} != {self._protected_tokens}"
        slots = self._concat(held)
        assert slots.unique().numel() == slots.numel(), "a kv slot is held by two tree positions"
        assert evictable + protected == self.total_size()

    def snapshot(self) -> dict[tuple[str | None, tuple[int, ...]], tuple[int, ...]]:
        """Every cached page as ``(namespace, tokens up to the page's end) -> its slots``.

        Read-only (no LRU update); meant for tests and debugging of small trees.
        """
        pages: dict[tuple[str | None, tuple[int, ...]], tuple[int, ...]] = {}
        for namespace, root in self._roots.items():
            for node in iter_subtree(root):
                prefix = self._path_tokens(node)
                start = len(prefix) - len(node.key)
                slots = node.kv_slots.tolist()
                for end in range(self.page_size, len(node.key) + 1, self.page_size):
                    page = tuple(slots[end - self.page_size : end])
                    pages[(namespace, prefix[: start + end])] = page
        return pages

    def format_tree(self) -> str:
        lines = [
            f"{type(self).__name__}(page_size={self.page_size}, "
            f"evictable={self._evictable_tokens}, protected={self._protected_tokens})"
        ]
        for namespace, root in self._roots.items():
            lines.append(f"namespace={namespace!r}")
            self._format_subtree(root, 1, lines)
        return "\n".join(lines)

    # ----------------------------------------------------------------------------- internals

    def _root(self, namespace: str | None) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_root()
        return root

    def _new_root(self) -> TreeNode:
        return TreeNode(key=(), kv_slots=self._concat([]), parent=None)

    def _all_nodes(self):
        for root in self._roots.values():
            yield from iter_subtree(root)

    def _common_len(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Length of the longest common page-aligned prefix of ``key`` and ``tokens[start:]``."""
        limit = min(len(key), len(tokens) - start)
        i = 0
        while i < limit and key[i] == tokens[start + i]:
            i += 1
        return i // self.page_size * self.page_size

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Cut ``node`` after ``split_len`` tokens; return the new upper half (a parent of node)."""
        parent = node.parent
        assert parent is not None and 0 < split_len < len(node.key)
        upper = TreeNode(
            key=node.key[:split_len],
            kv_slots=node.kv_slots[:split_len],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access_time=node.last_access_time,
        )
        parent.children[child_key(node.key, 0, self.page_size)] = upper
        node.key = node.key[split_len:]
        node.kv_slots = node.kv_slots[split_len:]
        node.parent = upper
        upper.children[child_key(node.key, 0, self.page_size)] = node
        return upper

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], kv_slots: torch.Tensor) -> TreeNode:
        slots = kv_slots.to(device=self.device, dtype=torch.int64).clone()
        leaf = TreeNode(key=key, kv_slots=slots, parent=parent, last_access_time=self._clock)
        parent.children[child_key(key, 0, self.page_size)] = leaf
        self._evictable_tokens += len(key)
        return leaf

    def _remove_leaf(self, node: TreeNode) -> int:
        parent = node.parent
        assert parent is not None and node.is_evictable_leaf
        del parent.children[child_key(node.key, 0, self.page_size)]
        self._evictable_tokens -= len(node.key)
        self._free_slots(node.kv_slots)
        return len(node.key)

    def _drop_empty_namespaces(self) -> None:
        empty = [ns for ns, root in self._roots.items() if ns is not None and not root.children]
        for namespace in empty:
            del self._roots[namespace]

    def _concat(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        if not pieces:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(pieces)

    @staticmethod
    def _path_tokens(node: TreeNode) -> tuple[int, ...]:
        keys: list[tuple[int, ...]] = []
        while not node.is_root:
            keys.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return tuple(t for key in reversed(keys) for t in key)

    @staticmethod
    def _where(node: TreeNode, more: str) -> str:
        """Where the node's KV lives, for ``format_tree``."""
        return f"slots={node.kv_slots[:_MAX_TOKENS_SHOWN].tolist()}{more}"

    def _format_subtree(self, node: TreeNode, depth: int, lines: list[str]) -> None:
        for child in sorted(node.children.values(), key=lambda n: n.key):
            shown = " ".join(map(str, child.key[:_MAX_TOKENS_SHOWN]))
            more = " ..." if len(child.key) > _MAX_TOKENS_SHOWN else ""
            lines.append(
                f"{'  ' * depth}[{shown}{more}] len={len(child.key)} {self._where(child, more)} "
                f"lock={child.lock_ref} t={child.last_access_time}"
            )
            self._format_subtree(child, depth + 1, lines)
