"""HiRadixCache: a restart is warm for what the stopped server served, whatever the write policy
(a prefix that left the device before the policy gave it a host copy, a prefix only the device
held at the stop); harness: hiradix_world."""

from __future__ import annotations

import pytest
from hiradix_world import seq, slow_prefill, tier_profile

from radixlm.radix.hiradix_cache import WRITE_POLICIES


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_a_graceful_stop_writes_what_only_the_device_holds(make_world, tmp_path, page_size, policy):
    ps = page_size
    world = make_world(ps, num_slots=16 * ps, policy=policy, disk_dir=tmp_path)
    tokens = seq(6 * ps + 1)
    num = world.cache.cacheable_len(len(tokens))
    world.run(tokens)  # served once: under write_back and selective only the device holds it
    world.cache.close()  # what a SIGTERM'd scheduler does
    assert world.store.num_pages() == num // ps
    world.restart()
    slow_prefill(world)
    match = world.match_and_load(tokens + (99,))  # the values are checked here
    assert (match.matched_len, match.num_disk_hit) == (num, num)
    world.check_all()


def test_a_stop_out_of_time_saves_nothing_and_leaks_nothing(make_world, tmp_path):
    world = make_world(4, num_slots=64, policy="write_back", disk_dir=tmp_path)
    world.run(seq(24))
    world.cache.close(save_s=0.0)
    assert world.store.num_pages() == 0
    world.check_all()


def test_selective_with_a_disk_tier_keeps_a_prefix_leaving_the_device(make_world, tmp_path):
    """Before: write_through_selective dropped a prefix evicted before its second hit, so a
    conversation's opening, churned out by other conversations, was never on disk."""
    world = make_world(4, num_slots=64, policy="write_through_selective", disk_dir=tmp_path)
    tokens = seq(24)
    world.run(tokens)
    world.cache.evict(world.num_slots)
    assert tier_profile(world.cache, tokens, None) == (0, 24)
    world.flush()
    world.restart()  # no save at the stop: the pages were written when they left the device
    slow_prefill(world)
    assert world.match_and_load(tokens + (99,)).num_disk_hit == 24
    world.check_all()
