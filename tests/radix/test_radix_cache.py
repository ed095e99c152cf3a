"""Deterministic behaviour of RadixCache: matching, splitting, pages, namespaces, LRU, locks."""

from __future__ import annotations

import pytest
import torch

from radixlm.radix import RadixCache


class FreedLog:
    """free_slots callback that records each call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, kv_slots: torch.Tensor) -> None:
        self.calls.append(kv_slots.tolist())

    def all(self) -> list[int]:
        return sorted(s for call in self.calls for s in call)


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make(page_size: int = 1) -> tuple[RadixCache, FreedLog]:
    log = FreedLog()
    return RadixCache(page_size=page_size, free_slots=log), log


def test_insert_returns_already_present_prefix_and_match_returns_first_slots() -> None:
    cache, _ = make()
    assert cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13)).num_present == 0
    assert cache.insert([1, 2, 5], slots(20, 21, 22)).num_present == 2
    result = cache.match_prefix([1, 2, 5, 9])
    assert result.matched_len == 3
    assert result.kv_slots.tolist() == [10, 11, 22]  # the tree keeps its own slots for [1, 2]
    assert cache.total_size() == 5 and cache.evictable_size() == 5
    cache.check_integrity()


def test_match_inside_a_node_splits_it() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    result = cache.match_prefix([1, 2, 9])
    assert result.matched_len == 2 and result.kv_slots.tolist() == [0, 1]
    assert result.last_node.key == (1, 2)
    assert [child.key for child in result.last_node.children.values()] == [(3, 4)]
    assert cache.format_tree().splitlines()[2:] == [
        "  [1 2] len=2 slots=[0, 1] lock=0 t=2",
        "    [3 4] len=2 slots=[2, 3] lock=0 t=1",
    ]
    cache.check_integrity()


def test_splitting_a_locked_node_keeps_both_halves_locked() -> None:
    cache, _ = make()
    cache.insert([0, 0, 0], slots(0, 1, 2))
    locked = cache.match_prefix([0, 0, 0])
    cache.inc_lock_ref(locked.last_node)
    assert (
        cache.insert([0, 7], slots(5, 6)).num_present == 1
    )  # splits the locked node after one token
    cache.check_integrity()
    assert cache.protected_size() == 3 and cache.evictable_size() == 1
    assert cache.evict(100) == 1
    cache.dec_lock_ref(locked.last_node)
    cache.check_integrity()
    assert cache.protected_size() == 0 and cache.evictable_size() == 3


def test_page_size_aligns_inserts_and_matches() -> None:
    cache, _ = make(page_size=4)
    assert cache.cacheable_len(10) == 8
    assert cache.insert(list(range(10)), torch.arange(100, 110)).num_present == 0
    assert cache.total_size() == 8  # the unaligned tail [8, 9] is not stored
    assert cache.match_prefix(list(range(7))).matched_len == 4
    assert cache.match_prefix(list(range(3))).matched_len == 0
    result = cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99, 8])  # mismatch inside page 2
    assert result.matched_len == 4 and result.kv_slots.tolist() == [100, 101, 102, 103]
    cache.check_integrity()


def test_pages_that_differ_inside_the_first_page_are_separate_children() -> None:
    cache, _ = make(page_size=4)
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    assert cache.insert([1, 2, 9, 9], slots(4, 5, 6, 7)).num_present == 0
    root = cache.match_prefix([]).last_node
    assert set(root.children) == {(1, 2, 3, 4), (1, 2, 9, 9)}
    cache.check_integrity()


def test_namespaces_never_match_each_other() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3], slots(0, 1, 2), namespace="salt-a")
    assert cache.match_prefix([1, 2, 3]).matched_len == 0
    assert cache.match_prefix([1, 2, 3], namespace="salt-b").matched_len == 0
    assert cache.match_prefix([1, 2, 3], namespace="salt-a").kv_slots.tolist() == [0, 1, 2]
    assert cache.insert([1, 2, 3], slots(5, 6, 7), namespace="salt-b").num_present == 0
    assert cache.match_prefix([1, 2], namespace="salt-b").kv_slots.tolist() == [5, 6]
    cache.check_integrity()


def test_emptied_namespace_is_dropped() -> None:
    cache, _ = make()
    cache.insert([1, 2], slots(0, 1), namespace="lora-7")
    assert "namespace='lora-7'" in cache.format_tree()
    cache.evict(2)
    assert "namespace='lora-7'" not in cache.format_tree()
    cache.check_integrity()


def test_eviction_order_is_least_recently_used() -> None:
    cache, log = make()
    cache.insert([1, 1], slots(10, 11))
    cache.insert([2, 2], slots(20, 21))
    cache.insert([3, 3], slots(30, 31))
    cache.match_prefix([1, 1])  # [1, 1] is now the most recently used
    assert cache.evict(1) == 2  # whole nodes: asking for 1 token frees the 2-token leaf
    assert log.calls == [[20, 21]]
    assert cache.evict(2) == 2
    assert log.calls[-1] == [30, 31]
    assert cache.evict(5) == 2
    assert log.calls[-1] == [10, 11]
    assert cache.total_size() == 0


def test_parent_becomes_evictable_after_its_children() -> None:
    cache, log = make()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    cache.insert([1, 2, 4], slots(5, 6, 7))
    cache.insert([9], slots(9))
    # Leaves by age: [3], [4], [9]. Once [3] and [4] are gone, [1 2] is a leaf older than [9].
    assert cache.evict(3) == 4
    assert log.calls == [[2], [7], [0, 1]]
    assert cache.match_prefix([9]).matched_len == 1


def test_locked_paths_survive_eviction() -> None:
    cache, log = make()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    cache.insert([1, 2, 4, 5], slots(0, 1, 6, 7))  # returns 2: slots 0 and 1 are duplicates
    cache.insert([8, 8], slots(8, 9))
    held = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(held.last_node)
    cache.inc_lock_ref(held.last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 4
    assert cache.evict(100) == 4
    assert log.all() == [6, 7, 8, 9]
    assert cache.match_prefix([1, 2, 3]).matched_len == 3
    cache.dec_lock_ref(held.last_node)
    assert cache.evict(100) == 0  # still locked once
    cache.dec_lock_ref(held.last_node)
    assert cache.evict(100) == 3
    cache.check_integrity()


def test_reset_frees_everything_once_and_refuses_while_locked() -> None:
    cache, log = make()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    cache.insert([1, 5], slots(3, 4))
    held = cache.match_prefix([1, 5])
    cache.inc_lock_ref(held.last_node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(held.last_node)
    cache.reset()
    assert log.all() == [0, 1, 2, 4]  # slot 3 was a duplicate the caller kept
    assert cache.total_size() == 0 and cache.match_prefix([1, 2]).matched_len == 0
    cache.check_integrity()


def test_tree_does_not_alias_the_callers_tensor() -> None:
    cache, _ = make()
    row = slots(0, 1, 2)
    cache.insert([1, 2, 3], row)
    row[:] = -1
    assert cache.match_prefix([1, 2, 3]).kv_slots.tolist() == [0, 1, 2]


def test_check_integrity_detects_corruption() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    cache.insert([1, 2, 4], slots(5, 6, 7))
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.check_integrity()
    node.lock_ref = 1  # locked more than its parent, and the counters disagree
    with pytest.raises(AssertionError):
        cache.check_integrity()
    node.lock_ref = 0
    node.kv_slots = slots(0)  # the slot also held by its parent
    with pytest.raises(AssertionError, match="two tree positions"):
        cache.check_integrity()


def test_unbalanced_unlock_is_caught() -> None:
    cache, _ = make()
    cache.insert([1], slots(0))
    node = cache.match_prefix([1]).last_node
    with pytest.raises(AssertionError, match="unlocked"):
        cache.dec_lock_ref(node)


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=0, free_slots=lambda s: None)
    with pytest.raises(ValueError, match="free_slots"):
        RadixCache(page_size=1)
    cache, _ = make()
    with pytest.raises(ValueError, match="one kv slot per token"):
        cache.insert([1, 2, 3], slots(0, 1))


def test_empty_inputs() -> None:
    cache, log = make()
    result = cache.match_prefix([])
    assert result.matched_len == 0 and result.kv_slots.numel() == 0
    assert result.kv_slots.dtype == torch.int64
    assert cache.insert([], slots()).num_present == 0
    assert cache.evict(10) == 0 and log.calls == []
    cache.inc_lock_ref(result.last_node)  # locking the root is a no-op
    cache.dec_lock_ref(result.last_node)
    cache.check_integrity()
