"""The radix-tree prefix cache (RadixAttention); a library that never imports radixlm.srt."""

from __future__ import annotations

import torch

from radixlm.radix.base import FreeSlotsFn, InsertResult, MatchResult, PrefixCache
from radixlm.radix.null_cache import NullCache
from radixlm.radix.radix_cache import RadixCache

__all__ = [
    "FreeSlotsFn",
    "InsertResult",
    "MatchResult",
    "NullCache",
    "PrefixCache",
    "RadixCache",
    "make_prefix_cache",
]


def make_prefix_cache(
    disabled: bool,
    page_size: int,
    free_slots: FreeSlotsFn,
    device: torch.device | str = "cpu",
) -> PrefixCache:
    """A RadixCache, or a NullCache when prefix caching is ``disabled``."""
    if disabled:
        return NullCache(page_size=page_size, device=device)
    return RadixCache(page_size=page_size, free_slots=free_slots, device=device)
