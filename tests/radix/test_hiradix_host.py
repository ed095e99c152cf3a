"""HiRadixCache, host tier: evict, back up and load back under each write policy, all or
nothing, the load-or-recompute choice, and copies that finish late (harness: hiradix_world)."""

from __future__ import annotations

import pytest
from hiradix_world import (
    device_slots_of,
    host_only_tokens,
    node_count,
    seq,
    slow_prefill,
    tier_profile,
    walk_tree,
)

# ------------------------------------------------------------------------------ host tier


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evict_to_host_then_load_back_gives_the_same_kv_at_new_slots(make_world, page_size, policy):
    world = make_world(page_size, num_slots=16 * page_size, policy=policy)
    tokens = seq(5 * page_size + 1)
    num = world.cache.cacheable_len(len(tokens))
    first = world.run(tokens)
    old_slots = set(first.slots[:num])
    assert world.cache.evict(num) == num
    world.check_all()
    assert world.cache.total_size() == 0 and host_only_tokens(world.cache) == num
    blocker = world.ledger.alloc(num)  # the freed pages are taken: the load gets other ones
    match = world.match_and_load(tokens)
    assert (match.matched_len, match.num_host_hit, match.num_disk_hit) == (num, num, 0)
    assert not old_slots & set(match.kv_slots.tolist())
    assert world.cache.stats.host_hit_tokens == world.cache.stats.load_back_tokens == num
    world.ledger.free(blocker)
    world.check_all()
    assert world.cache.tier_stats()["host_hit_rate"] > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_write_back_backs_up_only_at_eviction(make_world, page_size):
    world = make_world(page_size, num_slots=8 * page_size, policy="write_back")
    tokens = seq(6 * page_size)
    world.run(tokens)
    world.match_and_load(tokens)
    world.match_and_load(tokens)
    assert world.host_pool.used_size() == 0 and world.cache.stats.write_back_tokens == 0
    assert all(n.host_slots is None for _, n, _ in walk_tree(world.cache))
    world.cache.evict(len(tokens))
    world.check_all()
    assert world.host_pool.used_size() == len(tokens) == host_only_tokens(world.cache)
    assert world.cache.stats.device_evicted_to_host == len(tokens)


@pytest.mark.parametrize("page_size", [1, 4])
def test_write_through_backs_up_at_insert(make_world, page_size):
    world = make_world(page_size, num_slots=8 * page_size, policy="write_through")
    tokens = seq(3 * page_size + 1)
    world.run(tokens)
    world.check_all()  # the host copy holds the prefix's values
    num = world.cache.cacheable_len(len(tokens))
    assert world.host_pool.used_size() == num == world.cache.stats.write_back_tokens
    assert all(n.host_slots is not None for _, n, _ in walk_tree(world.cache))


@pytest.mark.parametrize("page_size", [1, 4])
def test_write_through_selective_backs_up_at_the_second_hit(make_world, page_size):
    world = make_world(page_size, num_slots=12 * page_size, policy="write_through_selective")
    hot, cold = seq(3 * page_size), seq(3 * page_size, base=50)
    world.run(hot)
    world.run(cold)
    world.match_and_load(hot)
    world.match_and_load(cold)
    assert world.host_pool.used_size() == 0, "backed up at the first hit"
    world.match_and_load(hot)
    world.check_all()
    assert world.host_pool.used_size() == len(hot), "not backed up at the second hit"
    world.cache.evict(world.num_slots)
    world.check_all()
    assert tier_profile(world.cache, hot, None) == (0, len(hot))
    assert tier_profile(world.cache, cold, None) == (0, 0), "cold was never backed up"


def test_a_full_host_pool_skips_backups_without_leaking(make_world):
    world = make_world(1, num_slots=16, host_tokens=4, policy="write_through")
    world.run(seq(8))  # larger than the host pool
    assert world.cache.stats.backups_skipped == 1
    world.check_all()
    assert world.host_pool.used_size() == 0
    world.run(seq(4, base=20))  # fits
    assert world.host_pool.used_size() == 4
    # the new page's ancestors fill the pool and may not leave it for their own child
    world.run(seq(4, base=20) + (7, 7, 7, 7))
    assert world.cache.stats.backups_skipped == 2
    world.check_all()
    world.cache.evict(16)
    world.check_all()
    assert world.cache.total_size() == 0 and not world.ledger.outstanding
    assert host_only_tokens(world.cache) == world.host_pool.used_size() == 4
    world.cache.reset()
    assert world.host_pool.used_size() == 0 and not world.ledger.outstanding


@pytest.mark.parametrize("page_size", [1, 4])
def test_load_back_is_all_or_nothing_when_the_device_pool_is_short(make_world, page_size):
    ps = page_size
    world = make_world(ps, num_slots=12 * ps, host_tokens=16 * ps, policy="write_through")
    tokens = seq(8 * ps)
    world.run(tokens[: 4 * ps])
    world.run(tokens)  # two nodes: [0, 4) and [4, 8) pages
    assert world.cache.evict(4 * ps) == 4 * ps  # the leaf goes to host memory
    other = world.admit(seq(8 * ps, base=100))  # a running request takes the other slots
    world.check_all([other])
    assert world.ledger.available() == 0
    match = world.match_and_load(tokens)
    assert (match.matched_len, match.num_host_hit) == (4 * ps, 0), "a partial load"
    assert world.cache.stats.loads_skipped_no_memory == 1
    assert tier_profile(world.cache, tokens, None) == (4 * ps, 4 * ps)
    world.check_all([other])
    world.release(other, keep_in_cache=False)
    match = world.match_and_load(tokens)
    assert (match.matched_len, match.num_host_hit) == (8 * ps, 4 * ps)
    world.check_all()


def test_a_locked_prefix_stays_on_the_device(make_world):
    world = make_world(1, num_slots=8, policy="write_back")
    req = world.admit(seq(6))
    world.insert(req)
    assert world.cache.evict(8) == 0
    world.check_all([req])
    assert world.alloc_for_cache(4) is None
    world.release(req)
    assert world.cache.evict(8) == 6
    world.check_all()


def test_match_prefix_moves_nothing(make_world):
    world = make_world(4, num_slots=32, host_tokens=32, policy="write_through")
    tokens = seq(12)
    world.run(tokens)
    world.cache.evict(32)
    stats = world.cache.tier_stats()
    match = world.match_prefix(tokens)
    assert match.matched_len == 0
    assert tier_profile(world.cache, tokens, None) == (0, 12)
    assert world.cache.tier_stats() == stats


@pytest.mark.parametrize("page_size", [1, 4])
def test_loads_slower_than_recomputing_are_skipped_and_kv_stays_right(make_world, page_size):
    world = make_world(page_size, num_slots=8 * page_size, policy="write_through")
    tokens = seq(6 * page_size)
    world.run(tokens)
    world.cache.evict(world.num_slots)
    for _ in range(5):  # recomputing looks nearly free
        world.cache.observe_prefill(10**6, 1e-6)
    req = world.admit(tokens)  # recomputes: the host copy is adopted with the new slots
    assert req.num_cached == 0
    assert world.cache.stats.loads_skipped_slower == 1
    world.insert(req)
    world.check_all([req])
    world.release(req)
    assert tier_profile(world.cache, tokens, None) == (len(tokens), 0)
    world.cache.evict(world.num_slots)
    slow_prefill(world)  # now loading pays off again
    match = world.match_and_load(tokens)
    assert (match.matched_len, match.num_host_hit) == (len(tokens), len(tokens))
    world.check_all()


def test_the_recompute_rate_counts_steps_whose_loads_hide_under_the_forward(make_world):
    """A prefill step admitted with loads runs their copies under its layers: a step whose
    copies are short against it counts as compute as it is (a restart where every step loads
    still learns the recompute rate); a step the copies may dominate is not counted."""
    world = make_world(4, num_slots=32, policy="write_through")
    tokens = seq(16)
    world.run(tokens)
    world.cache.evict(world.num_slots)
    assert world.match_and_load(tokens).num_host_hit == 16
    load_s = world.cache.controller.estimate_load_seconds(16)
    world.cache.observe_prefill(100, 1.5 * load_s)  # the copy may be most of it
    assert world.cache.stats.prefill_s_per_token is None
    world.cache.evict(world.num_slots)
    assert world.match_and_load(tokens).num_host_hit == 16
    world.cache.observe_prefill(100, 100e-3 + 2 * load_s)
    assert world.cache.stats.prefill_s_per_token == pytest.approx(1e-3 + 0.02 * load_s)
    world.cache.observe_prefill(100, 50e-3)  # no loads since: measured as it is
    expected = 0.8 * (1e-3 + 0.02 * load_s) + 0.2 * 0.5e-3
    assert world.cache.stats.prefill_s_per_token == pytest.approx(expected)


def test_insert_over_host_only_nodes_takes_the_callers_slots(make_world):
    world = make_world(1, num_slots=16, policy="write_back")
    tokens = seq(8)
    world.run(tokens)
    world.cache.evict(16)
    world.cache.observe_prefill(10**6, 1e-6)  # loads look slower: the request recomputes
    req = world.admit(tokens + (1, 2))
    assert req.num_cached == 0
    world.insert(req)  # num_present 0: every position past the device part is the caller's
    assert device_slots_of(world.cache, req.tokens, None) == req.slots
    world.check_all([req])
    assert world.host_pool.used_size() == 8  # the host copy stays, beside the device one
    world.release(req)
    world.check_all()


# ------------------------------------------------------------------------------ late copies


@pytest.mark.parametrize("page_size", [1, 4])
def test_unfinished_backups_are_waited_for_before_their_slots_go(make_world, page_size):
    ps = page_size
    world = make_world(ps, num_slots=16 * ps, policy="write_through", lazy_copies=True)
    tokens = seq(8 * ps)
    world.run(tokens)
    assert [n.write_op is not None for _, n, _ in walk_tree(world.cache)] == [True]
    world.match_and_load(tokens[: 4 * ps] + (77,) * ps)  # splits the node being copied
    assert node_count(world.cache) == 2
    world.check_all()
    assert world.cache.evict(16 * ps) == 8 * ps  # waits for the copy, then frees the slots
    world.check_all()  # the host copy holds the values, not the poison of freed slots
    match = world.match_and_load(tokens)
    assert match.num_host_hit == 8 * ps
    world.check_all()


def test_close_finishes_unfinished_backups_and_stores_their_pages(make_world, tmp_path):
    world = make_world(4, num_slots=32, policy="write_through", disk_dir=tmp_path, lazy_copies=True)
    tokens = seq(12)
    world.run(tokens)
    assert world.cache._pending_writes and world.store.num_pages() == 0
    world.cache.close()  # shutting down: the copy finishes and its pages reach the disk
    world.store.close()
    world.lazy_copies = False
    world.build()  # the next process
    assert world.store.num_pages() == 3
    slow_prefill(world)
    assert world.match_and_load(tokens).num_disk_hit == 12
    world.check_all()
