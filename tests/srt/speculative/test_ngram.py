"""The n-gram drafter: matches in the request's own tokens (against a brute-force reference),
continuations read from the prefix cache (RadixCache and HiRadixCache, without changing them),
adaptive lengths, bounded per-request state and release."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.hicache.controller import HiCacheController
from radixlm.hicache.copy_engine import SyncCopyEngine
from radixlm.hicache.host_pool import HostKVPool
from radixlm.radix import NullCache, RadixCache
from radixlm.radix.hiradix_cache import HiRadixCache
from radixlm.srt.config import ServerConfig
from radixlm.srt.speculative import NullDrafter, make_drafter
from radixlm.srt.speculative.adaptive import FIRST_PAUSE_STEPS, MISSES_BEFORE_PAUSE
from radixlm.srt.speculative.ngram import MAX_CANDIDATES, NgramDrafter


def _drafter(cache=None, k: int = 4, **kw) -> NgramDrafter:
    return NgramDrafter(cache or NullCache(), k, **kw)


def _propose(drafter: NgramDrafter, req, k: int = 4) -> list[int]:
    (draft,) = drafter.propose([req], [k])
    assert draft.probs is None and len(draft) <= k
    return draft.token_ids


def brute_force(tokens: list[int], min_match: int, max_match: int, k: int) -> list[int]:
    """The longest suffix (min..max tokens) found earlier, among the ``MAX_CANDIDATES`` most
    recent occurrences of its last ``min_match`` tokens, the most recent on ties; the tokens
    that followed it, continued periodically."""
    n = len(tokens)
    best_end, best_len, seen = -1, 0, 0
    for end in range(n - 1, min_match - 1, -1):  # most recent first
        length = 0
        while length < min(max_match, end) and tokens[end - 1 - length] == tokens[n - 1 - length]:
            length += 1
        if length < min_match:
            continue
        seen += 1
        if seen > MAX_CANDIDATES:
            break
        if length > best_len:
            best_end, best_len = end, length
    if best_end < 0:
        return []
    out = tokens[best_end : min(best_end + k, n)]
    while len(out) < k:
        out.append(out[len(out) - (n - best_end)])
    return out


# --------------------------------------------------------------------------- own tokens


def test_proposes_what_followed_the_suffix(make_req) -> None:
    d = _drafter()
    assert _propose(d, make_req([1, 2, 3, 4, 5, 9, 1, 2])) == [3, 4, 5, 9]
    assert _propose(d, make_req([1, 2, 3, 4, 5, 9, 1, 2]), k=2) == [3, 4]
    assert _propose(d, make_req([1, 2, 3, 4, 5, 9, 1, 2]), k=0) == []


def test_longest_suffix_wins_then_the_most_recent(make_req) -> None:
    d = _drafter()
    # "5 1 2" occurred at the start (3 tokens), "6 1 2" later (2 tokens): the longer wins
    assert _propose(d, make_req([5, 1, 2, 3, 6, 1, 2, 4, 5, 1, 2]), k=1) == [3]
    # two occurrences of equal length: the most recent
    assert _propose(d, make_req([1, 2, 3, 7, 1, 2, 4, 8, 1, 2]), k=1) == [4]


def test_min_and_max_match(make_req) -> None:
    assert _propose(_drafter(), make_req([7, 1, 5, 1])) == []  # one shared token < min_match 2
    assert _propose(_drafter(min_match=1), make_req([7, 1, 5, 1]), k=2) == [5, 1]
    # max_match caps the compared suffix: 3 and 2 both match 2 tokens, the most recent wins
    tokens = [1, 2, 3, 4, 9, 8, 3, 4, 0, 1, 2, 3, 4]
    assert _propose(_drafter(max_match=2), make_req(tokens), k=1) == [0]
    assert _propose(_drafter(max_match=8), make_req(tokens), k=1) == [9]


def test_a_repeating_tail_continues_as_a_loop(make_req) -> None:
    assert _propose(_drafter(k=6), make_req([4, 1, 2, 1, 2, 1, 2]), k=6) == [1, 2, 1, 2, 1, 2]
    assert _propose(_drafter(), make_req([3, 3, 3])) == [3, 3, 3, 3]


@pytest.mark.parametrize("seed", range(8))
def test_incremental_index_matches_brute_force(make_req, seed: int) -> None:
    rng = random.Random(seed)
    min_match, max_match = rng.choice([(1, 3), (2, 4), (2, 8)])
    d = _drafter(k=5, min_match=min_match, max_match=max_match, adaptive=False)
    req = make_req([rng.randrange(20) for _ in range(rng.randrange(1, 30))])
    for _ in range(150):
        expected = brute_force(req.tokens, min_match, max_match, 5)
        assert _propose(d, req, k=5) == expected, req.tokens
        # tokens arrive in bursts, as accepted drafts do; sometimes copying an earlier run
        if rng.random() < 0.3 and len(req.tokens) > 5:
            start = rng.randrange(len(req.tokens) - 3)
            req.output_ids += req.tokens[start : start + rng.randrange(1, 4)]
        else:
            req.output_ids += [rng.randrange(20) for _ in range(rng.randrange(1, 4))]


def test_a_cut_sequence_is_reindexed(make_req) -> None:
    d = _drafter()
    req = make_req([1, 2, 3, 4, 5, 6, 7, 8], [9, 1, 2])
    assert _propose(d, req) == [3, 4, 5, 6]
    req.output_ids = [5, 6]  # an edit replaced the output
    assert _propose(d, req) == [7, 8, 5, 6]


def test_state_is_bounded_and_released(make_req) -> None:
    d = _drafter(window=64)
    req = make_req(list(range(5)))
    rng = random.Random(0)
    for _ in range(400):
        req.output_ids += [rng.randrange(1000) for _ in range(5)]
        d.propose([req], [4])
        assert d._states[req.rid].index.num_entries() <= 2 * 64 + 5
    assert len(d._states[req.rid].index.prev) == 64
    assert d.num_tracked() == 1
    d.release(req)
    d.release(req)  # twice is harmless
    assert d.num_tracked() == 0
    assert d.stats()["num_proposed"] == 0


def test_matches_only_inside_the_window(make_req) -> None:
    d = _drafter(window=16)
    req = make_req([1, 2, 3] + list(range(100, 140)) + [1, 2])
    assert _propose(d, req) == []  # the earlier "1 2" is 40 positions back
    assert _propose(_drafter(window=64), req) == [3, 100, 101, 102]


# --------------------------------------------------------------------------- prefix cache


def _radix(page_size: int = 1) -> RadixCache:
    return RadixCache(page_size=page_size, free_slots=lambda slots: None)


def _insert(cache, tokens: list[int], first_slot: int = 1) -> None:
    cache.insert(tokens, torch.arange(first_slot, first_slot + len(tokens)))


def test_continuation_from_the_radix_tree(make_req) -> None:
    cache = _radix()
    _insert(cache, [10, 11, 12, 13, 14, 15, 16, 17])
    _insert(cache, [10, 11, 12, 20, 21], first_slot=50)
    before = cache.format_tree()
    d = _drafter(cache)
    # the whole sequence is a prefix of a cached one: its continuation, not an n-gram match
    assert _propose(d, make_req([10, 11], [12, 13])) == [14, 15, 16, 17]
    assert _propose(d, make_req([10, 11, 12, 13, 14, 15, 16, 17])) == []  # nothing further
    assert _propose(d, make_req([10, 11, 99])) == []
    # a branch: the most recently used child (the second insert stamped it later)
    assert _propose(d, make_req([10, 11, 12]), k=2) == [20, 21]
    assert cache.format_tree() == before  # no LRU stamp, no split, no lock
    cache.check_integrity()
    assert d.stats()["num_drafts_from_cache"] == 2


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_continuation_against_brute_force(page_size: int) -> None:
    rng = random.Random(page_size)
    cache = _radix(page_size)
    cached: set[tuple[int, ...]] = set()
    for i in range(30):
        base = rng.choice(sorted(cached)) if cached and rng.random() < 0.6 else ()
        seq = list(base[: rng.randrange(len(base) + 1)]) + [
            rng.randrange(4) for _ in range(rng.randrange(1, 12))
        ]
        _insert(cache, seq, first_slot=1000 * i)
        cached.add(tuple(seq[: cache.cacheable_len(len(seq))]))
    before = cache.format_tree()
    for _ in range(300):
        source = rng.choice(sorted(cached))
        query = list(source[: rng.randrange(len(source) + 1)])
        if rng.random() < 0.3:
            query.append(rng.randrange(4))
        k = rng.randrange(1, 8)
        got = cache.continuation(query, k)
        n = len(query)
        extends = [c for c in cached if len(c) > n and list(c[:n]) == query]
        assert bool(got) == (bool(extends) and n > 0), (query, got)
        if got:
            full = query + got
            assert len(got) <= k
            assert any(list(c[: len(full)]) == full for c in cached)
            if len(got) < k:  # stopped at a leaf: nothing cached goes further
                assert not any(len(c) > len(full) and list(c[: len(full)]) == full for c in cached)
    assert cache.format_tree() == before


class CountingCache(RadixCache):
    calls = 0

    def continuation(self, *args, **kwargs):
        self.calls += 1
        return super().continuation(*args, **kwargs)


def test_prefix_cache_lookups_back_off_after_misses(make_req) -> None:
    cache = CountingCache(page_size=1, free_slots=lambda slots: None)
    d = _drafter(cache, adaptive=False)
    req = make_req([50, 51, 52])
    asked = []
    for step in range(20):
        before = cache.calls
        d.propose([req], [4])
        asked += [step] if cache.calls > before else []
        req.output_ids.append(60 + step)
    assert asked == [0, 2, 5, 10, 19]  # waits of 1, 2, 4, 8 steps after each miss
    # another request went further: found at the next lookup (16 steps on), then every step
    _insert(cache, req.tokens + [7, 8, 9, 10, 11])
    drafts = [_propose(d, req) for _ in range(18)]
    assert drafts[:16] == [[]] * 16
    assert drafts[16:] == [[7, 8, 9, 10]] * 2
    assert cache.calls == 5 + 2


def test_continuation_with_pages_and_namespaces() -> None:
    cache = _radix(page_size=4)
    _insert(cache, list(range(12)) + [99])  # 12 tokens cached (3 pages), the 13th not
    assert cache.continuation([0, 1, 2, 3, 4, 5], 3) == [6, 7, 8]
    assert cache.continuation([0, 1], 20) == list(range(2, 12))
    assert cache.continuation(list(range(12)), 4) == []
    assert cache.continuation([0, 1, 5], 4) == []
    assert cache.continuation([0, 1], 3, namespace="other") == []
    assert NullCache().continuation([0, 1], 3) == []


def test_continuation_reads_host_resident_nodes_of_the_hicache() -> None:
    layers, heads, dim, slots = 1, 1, 2, 64
    k = [torch.zeros(slots + 1, heads, dim)]
    v = [torch.zeros(slots + 1, heads, dim)]
    host = HostKVPool(64, 4, layers, heads, dim, torch.float32)
    controller = HiCacheController(k, v, host, SyncCopyEngine(), calibration_bytes=64)
    freed: list[int] = []
    cache = HiRadixCache(
        page_size=4,
        free_slots=lambda s: freed.extend(s.tolist()),
        alloc_slots=lambda n: None,
        controller=controller,
        write_policy="write_through",
    )
    tokens = list(range(30, 46))
    result = cache.insert(tokens, torch.arange(1, 17))
    cache.inc_lock_ref(result.last_node)
    cache.dec_lock_ref(result.last_node)
    cache.tier_stats()  # finish the host copies
    assert cache.evict(16) == 16  # device copies dropped, host copies kept
    assert cache.evictable_size() == 0
    before = cache.format_tree()
    assert cache.continuation(tokens[:5], 6) == tokens[5:11]
    assert cache.format_tree() == before
    cache.check_integrity()
    cache.close()


# --------------------------------------------------------------------------- adaptivity


def test_adaptive_length_shrinks_pauses_probes_and_grows(make_req) -> None:
    d = _drafter(k=8)
    req = make_req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2])
    assert len(_propose(d, req, k=8)) == 8
    for _ in range(MISSES_BEFORE_PAUSE):
        proposed = _propose(d, req, k=8)
        assert proposed
        d.observe(req, len(proposed), 0)
    paused = [_propose(d, req, k=8) for _ in range(FIRST_PAUSE_STEPS)]
    assert paused == [[]] * FIRST_PAUSE_STEPS
    probe = _propose(d, req, k=8)
    assert 1 <= len(probe) <= 2  # halved per miss
    d.observe(req, len(probe), 0)  # the probe fails: a longer pause
    assert [_propose(d, req, k=8) for _ in range(2 * FIRST_PAUSE_STEPS)] == [[]] * (
        2 * FIRST_PAUSE_STEPS
    )
    probe = _propose(d, req, k=8)
    d.observe(req, len(probe), len(probe))  # accepted: the length grows back
    assert len(_propose(d, req, k=8)) == 2 * len(probe)
    d.observe(req, 2 * len(probe), 1)  # partly accepted: accepted + 1
    assert len(_propose(d, req, k=8)) == 2
    stats = d.stats()
    assert stats["num_accepted"] == len(probe) + 1
    assert stats["num_verified"] == MISSES_BEFORE_PAUSE + 3


def test_disabled_adaptivity_keeps_the_length(make_req) -> None:
    d = _drafter(k=4, adaptive=False)
    req = make_req([1, 2, 3, 4, 5, 6, 1, 2])
    for _ in range(10):
        assert len(_propose(d, req)) == 4
        d.observe(req, 4, 0)


# --------------------------------------------------------------------------- registry


def test_registry_builds_the_configured_drafter() -> None:
    cache = _radix()
    assert isinstance(make_drafter(ServerConfig(), None, cache), NullDrafter)
    cfg = ServerConfig(
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=3,
        speculative_ngram_min_match=1,
        speculative_ngram_max_match=5,
        speculative_disable_adaptive=True,
    )
    d = make_drafter(cfg, None, cache)
    assert isinstance(d, NgramDrafter) and d.name == "ngram"
    assert (d.min_match, d.max_match, d.lengths.max_len, d.lengths.enabled) == (1, 5, 3, False)
    assert d.cache is cache
    null = NullDrafter()
    assert [x.token_ids for x in null.propose([object()], [3])] == [[]]
    assert null.stats()["num_proposed"] == 0
