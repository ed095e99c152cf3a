"""NullCache caches nothing yet honours the PrefixCache contract; make_prefix_cache picks one."""

from __future__ import annotations

import pytest
import torch

from radixlm.radix import NullCache, PrefixCache, RadixCache, make_prefix_cache


def test_null_cache_never_matches_or_keeps_anything() -> None:
    cache = NullCache(page_size=1)
    kv_slots = torch.tensor([4, 5, 6])
    inserted = cache.insert([1, 2, 3], kv_slots)
    assert inserted.num_present == 0 and inserted.kv_slots.numel() == 0
    assert inserted.last_node is None
    assert cache.cacheable_len(3) == 0  # so the caller keeps and frees all three slots
    result = cache.match_prefix([1, 2, 3])
    assert result.matched_len == 0
    assert result.kv_slots.numel() == 0 and result.kv_slots.dtype == torch.int64
    cache.inc_lock_ref(result.last_node)
    assert cache.protected_size() == 0
    cache.dec_lock_ref(result.last_node)
    assert cache.evict(100) == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    cache.reset()
    cache.check_integrity()
    assert "disabled" in cache.format_tree()


def test_null_cache_validates_like_the_radix_cache() -> None:
    with pytest.raises(ValueError, match="page_size"):
        NullCache(page_size=0)
    with pytest.raises(ValueError, match="one kv slot per token"):
        NullCache().insert([1, 2], torch.tensor([0]))


def test_make_prefix_cache_picks_the_implementation() -> None:
    freed: list[torch.Tensor] = []
    enabled = make_prefix_cache(disabled=False, page_size=4, free_slots=freed.append)
    disabled = make_prefix_cache(disabled=True, page_size=4, free_slots=freed.append)
    assert isinstance(enabled, RadixCache) and enabled.page_size == 4
    assert isinstance(disabled, NullCache) and disabled.page_size == 4
    assert isinstance(enabled, PrefixCache) and isinstance(disabled, PrefixCache)
    enabled.insert(list(range(4)), torch.arange(4))
    enabled.reset()
    assert [t.tolist() for t in freed] == [[0, 1, 2, 3]]
