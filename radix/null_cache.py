"""NullCache: the prefix cache that caches nothing (``--disable-radix-cache``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlm.radix.base import InsertResult, MatchResult, PrefixCache


class NullCache(PrefixCache):
    """Same interface as RadixCache, no caching.

    ``match_prefix`` matches nothing, ``insert`` keeps nothing (``num_present`` 0, no slots), and
    ``cacheable_len`` is 0, so by the ownership rules the caller keeps (and frees) every slot it
    passes in. Lock calls accept any handle and do nothing; ``evict`` frees nothing.
    """

    def __init__(self, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)

    def match_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> MatchResult:
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return MatchResult(kv_slots=empty, matched_len=0, last_node=None)

    def insert(
        self, token_ids: Sequence[int], kv_slots: torch.Tensor, namespace: str | None = None
    ) -> InsertResult:
        if kv_slots.dim() != 1 or kv_slots.numel() != len(token_ids):
            raise ValueError(
                f"insert needs one kv slot per token id: got {len(token_ids)} token ids and "
                f"kv_slots of shape {tuple(kv_slots.shape)}"
            )
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return InsertResult(num_present=0, kv_slots=empty, last_node=None)

    def cacheable_len(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: object) -> None:
        pass

    def dec_lock_ref(self, node: object) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass

    def format_tree(self) -> str:
        return "NullCache (prefix caching disabled)"
