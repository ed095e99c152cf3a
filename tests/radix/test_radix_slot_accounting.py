"""Slot accounting under the scheduler's protocol, for RadixCache (page 1 and 4) and NullCache.

A tiny allocator refuses double frees; simulated requests are admitted (match at most
len(prompt) - 1 tokens, lock, allocate the rest, evicting when short), decode, cache finished
chunks and finish, all through the PrefixCache interface with no cache-specific branches. After
every step every slot is in exactly one place (free, in the cache, or owned by a live request);
once idle ``available + evictable + protected == pool size``, and after ``reset`` every slot is
free again: no leak, no double free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from quick import examples

from radixlm.radix import PrefixCache, make_prefix_cache

POOL_SIZE = 24


class SlotPool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.free_slots = set(range(size))

    def available(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free_slots):
            return None
        return [self.free_slots.pop() for _ in range(n)]

    def free(self, kv_slots: torch.Tensor | list[int]) -> None:
        values = kv_slots.tolist() if isinstance(kv_slots, torch.Tensor) else kv_slots
        for slot in values:
            assert 0 <= slot < self.size and slot not in self.free_slots, f"double free of {slot}"
            self.free_slots.add(slot)


@dataclass
class SimReq:
    tokens: list[int]
    kv_slots: list[int]  # one per token; [:num_cached] belong to the cache
    num_cached: int
    last_node: Any

    def owned(self) -> int:
        return len(self.kv_slots) - self.num_cached


def alloc_or_evict(cache: PrefixCache, pool: SlotPool, n: int) -> list[int] | None:
    if pool.available() < n:
        cache.evict(n - pool.available())
    return pool.alloc(n)


def admit(cache: PrefixCache, pool: SlotPool, prompt: list[int]) -> SimReq | None:
    match = cache.match_prefix(prompt[:-1])
    cache.inc_lock_ref(match.last_node)
    new_slots = alloc_or_evict(cache, pool, len(prompt) - match.matched_len)
    if new_slots is None:
        cache.dec_lock_ref(match.last_node)
        return None
    return SimReq(
        list(prompt), match.kv_slots.tolist() + new_slots, match.matched_len, match.last_node
    )


def decode(cache: PrefixCache, pool: SlotPool, req: SimReq, new_tokens: list[int]) -> None:
    new_slots = alloc_or_evict(cache, pool, len(new_tokens))
    if new_slots is not None:
        req.tokens += new_tokens
        req.kv_slots += new_slots


def cache_chunk(cache: PrefixCache, pool: SlotPool, req: SimReq) -> None:
    """Unfinished request: hand the computed prefix to the cache, keep running on its slots."""
    inserted = cache.insert(req.tokens, torch.tensor(req.kv_slots), None)
    assert inserted.num_present >= req.num_cached
    pool.free(req.kv_slots[req.num_cached : inserted.num_present])
    num_cached = len(inserted.kv_slots)
    assert num_cached == cache.cacheable_len(len(req.tokens))
    req.kv_slots[:num_cached] = inserted.kv_slots.tolist()
    cache.inc_lock_ref(inserted.last_node)
    cache.dec_lock_ref(req.last_node)
    req.num_cached, req.last_node = num_cached, inserted.last_node


def finish(cache: PrefixCache, pool: SlotPool, req: SimReq) -> None:
    num_present = cache.insert(req.tokens, torch.tensor(req.kv_slots), None).num_present
    assert num_present >= req.num_cached
    pool.free(req.kv_slots[req.num_cached : num_present])
    pool.free(req.kv_slots[cache.cacheable_len(len(req.tokens)) :])
    cache.dec_lock_ref(req.last_node)


def check_accounting(cache: PrefixCache, pool: SlotPool, reqs: list[SimReq]) -> None:
    cache.check_integrity()
    in_flight = sum(r.owned() for r in reqs)
    assert pool.available() + cache.total_size() + in_flight == pool.size
    assert cache.evictable_size() + cache.protected_size() == cache.total_size()


OPS = st.one_of(
    st.tuples(st.just("admit"), st.lists(st.integers(0, 2), min_size=1, max_size=12)),
    st.tuples(
        st.just("decode"), st.integers(0, 7), st.lists(st.integers(0, 2), min_size=1, max_size=3)
    ),
    st.tuples(st.just("chunk"), st.integers(0, 7)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
)


def run_ops(cache: PrefixCache, pool: SlotPool, ops: list[tuple]) -> None:
    reqs: list[SimReq] = []
    for op in ops:
        if op[0] == "admit":
            req = admit(cache, pool, op[1])
            reqs += [req] if req is not None else []
        elif reqs and op[0] == "decode":
            decode(cache, pool, reqs[op[1] % len(reqs)], op[2])
        elif reqs and op[0] == "chunk":
            cache_chunk(cache, pool, reqs[op[1] % len(reqs)])
        elif reqs and op[0] == "finish":
            finish(cache, pool, reqs.pop(op[1] % len(reqs)))
        check_accounting(cache, pool, reqs)
    while reqs:
        finish(cache, pool, reqs.pop())
    assert cache.protected_size() == 0
    assert pool.available() + cache.evictable_size() + cache.protected_size() == pool.size


@pytest.mark.parametrize(("disabled", "page_size"), [(False, 1), (False, 4), (True, 1)])
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, max_size=40))
def test_no_slot_leaks_or_double_frees(disabled: bool, page_size: int, ops: list[tuple]) -> None:
    pool = SlotPool(POOL_SIZE)
    cache = make_prefix_cache(disabled=disabled, page_size=page_size, free_slots=pool.free)
    run_ops(cache, pool, ops)
    cache.reset()
    assert pool.free_slots == set(range(POOL_SIZE))


def test_second_identical_prompt_reuses_all_but_the_last_token() -> None:
    pool = SlotPool(POOL_SIZE)
    cache = make_prefix_cache(disabled=False, page_size=1, free_slots=pool.free)
    first = admit(cache, pool, [5, 6, 7, 8])
    assert first is not None and first.num_cached == 0
    finish(cache, pool, first)
    second = admit(cache, pool, [5, 6, 7, 8])
    assert second is not None and second.num_cached == 3
    assert second.kv_slots[:3] == first.kv_slots[:3]
    finish(cache, pool, second)
    assert pool.available() + cache.evictable_size() == POOL_SIZE
