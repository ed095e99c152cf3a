"""HiRadixCache, disk tier: warm restarts, runs of pages past the tree, damaged and faulty
stores, other models, and namespaces on every tier (harness: hiradix_world)."""

from __future__ import annotations

import time

import pytest
import torch
from hiradix_world import (
    FINGERPRINT,
    device_slots_of,
    faulty_store,
    seq,
    settle,
    slow_prefill,
    spill,
    tier_profile,
    walk_tree,
)

from radixlm.hicache.disk_store import DiskPageStore
from radixlm.hicache.page_hash import page_keys
from radixlm.radix.hiradix_cache import WRITE_POLICIES, HiRadixCache
from radixlm.radix.hiradix_disk import WAIT_COMPLETE_MAX_S

# ------------------------------------------------------------------------------ disk tier


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_a_restart_starts_warm_from_disk(make_world, tmp_path, page_size, policy):
    ps = page_size
    world = make_world(ps, num_slots=16 * ps, policy=policy, disk_dir=tmp_path)
    tokens = seq(6 * ps + 1)
    num = world.cache.cacheable_len(len(tokens))
    world.run(tokens)
    spill(world, tokens)
    assert world.store.num_pages() == num // ps
    world.restart()
    assert world.cache.total_size() == 0 and world.host_pool.used_size() == 0
    slow_prefill(world)
    match = world.match_and_load(tokens + (99,))  # the values are checked here
    assert (match.matched_len, match.num_host_hit, match.num_disk_hit) == (num, 0, num)
    assert world.cache.stats.disk_hit_tokens == num
    world.check_all()
    # a longer request continues from the loaded prefix
    world.run(tokens + (99,) * ps)
    world.check_all()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("prefix_tier", ["device", "host"])
def test_disk_pages_continue_a_prefix_in_the_tree(make_world, tmp_path, page_size, prefix_tier):
    ps = page_size
    world = make_world(ps, num_slots=16 * ps, policy="write_back", disk_dir=tmp_path)
    tokens = seq(6 * ps)
    world.run(tokens)
    spill(world, tokens)
    world.restart()
    slow_prefill(world)
    world.run(tokens[: 2 * ps])  # recomputed: in the tree again, its disk pages unread
    if prefix_tier == "host":
        world.cache.evict(16 * ps)
    world.cache.prefetch(tokens)  # the reads start ahead of the admission
    match = world.match_and_load(tokens)
    num_host = 2 * ps if prefix_tier == "host" else 0
    assert (match.matched_len, match.num_host_hit, match.num_disk_hit) == (6 * ps, num_host, 4 * ps)
    world.check_all()


def test_prefetched_pages_are_dropped_when_no_waiting_request_wants_them(make_world, tmp_path):
    """Reads started for requests that then leave the queue unadmitted (aborts), or whose load
    is not taken, are not kept: a page goes when the last request that asked for it lets go."""
    ps = 4
    world = make_world(ps, num_slots=16 * ps, policy="write_through", disk_dir=tmp_path)
    tokens = seq(6 * ps)
    world.run(tokens)
    world.flush()
    world.restart()
    disk = world.cache.disk
    first = world.cache.prefetch(tokens)
    second = world.cache.prefetch(tokens[: 3 * ps])  # shares the first three pages
    assert len(first) == 6 and disk.num_prefetched == 6
    assert world.cache.tier_stats()["disk_prefetched_pages"] == 6
    world.cache.release_prefetch(first)  # the first request is aborted while queued
    assert disk.num_prefetched == 3  # the shared pages stay for the second
    world.cache.release_prefetch(second)
    assert disk.num_prefetched == 0 and not disk._wanted
    world.cache.release_prefetch(None)  # no disk run: nothing to give back
    # what a match did not consume goes with the release after admission
    handle = world.cache.prefetch(tokens)
    slow_prefill(world)
    world.match_and_load(tokens[: 2 * ps])
    assert disk.num_prefetched == 4
    world.cache.release_prefetch(handle)
    assert disk.num_prefetched == 0
    world.check_all()


def test_reads_ahead_land_in_reserved_host_pages_and_are_used_in_place(make_world, tmp_path):
    """A prefetch reads pages straight into host pages it reserves (at most a quarter of the
    pool; the rest into read buffers); the admission's host-only node takes those very pages;
    pages of a prefetch let go unadmitted go back once their reads are done."""
    ps = 4
    world = make_world(ps, num_slots=16 * ps, host_tokens=64, disk_dir=tmp_path)
    tokens = seq(6 * ps)
    world.run(tokens)
    spill(world, tokens)
    world.restart()
    disk = world.cache.disk
    handle = world.cache.prefetch(tokens)
    reserved = disk.reserved_page_ids()
    assert len(reserved) == disk.num_reserved == 4  # 16 pages: a quarter
    assert world.host_pool.used_size() == 4 * ps
    world.check_all()  # the reserved pages count as held: the host pool's sum holds
    slow_prefill(world)
    match = world.match_and_load(tokens)
    assert match.num_disk_hit == 6 * ps and disk.num_reserved == 0
    (node,) = [n for _, n, _ in walk_tree(world.cache) if n.kv_slots is not None]
    assert set(reserved) <= set(world.host_pool.page_ids(node.host_slots).tolist())
    world.cache.release_prefetch(handle)
    world.check_all()
    world.restart()  # a request that prefetched and was aborted while queued
    handle = world.cache.prefetch(tokens)
    assert world.cache.disk.num_reserved == 4
    world.cache.release_prefetch(handle)
    settle(world)
    assert world.host_pool.used_size() == 0
    world.check_all()


def test_a_page_damaged_in_the_middle_ends_the_disk_hit_there(make_world, tmp_path):
    ps = 4
    world = make_world(ps, num_slots=16 * ps, policy="write_through", disk_dir=tmp_path)
    tokens = seq(3 * ps)
    world.run(tokens)
    world.flush()
    keys = page_keys(tokens, ps)
    faulty_store.flip_payload_byte(world.store.page_path(keys[1]))
    world.restart()
    slow_prefill(world)
    match = world.match_and_load(tokens)
    assert (match.matched_len, match.num_disk_hit) == (ps, ps)
    assert not world.store.exists(keys[1]), "the corrupt page was not dropped"
    world.check_all()
    world.run(tokens)  # the rest is recomputed and stored again
    world.flush()
    assert all(world.store.exists(k) for k in keys)
    world.check_all()


DAMAGING_MODES = ["truncate", "flip", "wrong_tokens"]


@pytest.mark.parametrize("mode", [*DAMAGING_MODES, "fail", "stall"])
def test_a_faulty_disk_read_is_a_miss_and_leaks_nothing(make_world, tmp_path, mode):
    ps = 4
    world = make_world(ps, num_slots=16 * ps, disk_dir=tmp_path, fault_mode="ok")
    tokens = seq(3 * ps)
    world.run(tokens)
    world.flush()
    assert world.store.num_pages() == 3
    world.restart(fault_mode=mode, stall_s=30.0)
    if mode == "stall":  # recomputing 12 tokens takes 0.6 s: the admission waits that long
        world.cache.observe_prefill(len(tokens), 0.6)
    else:
        slow_prefill(world)  # every read finishes before the deadline
    started = time.perf_counter()
    match = world.match_and_load(tokens)
    assert time.perf_counter() - started < 5.0, "the admission waited for a stalled disk"
    assert (match.matched_len, match.num_disk_hit) == (0, 0)
    assert world.faulty.faults > 0
    world.faulty.release()  # the disk is healthy again; stalled reads go on
    settle(world)
    world.check_all()
    assert world.host_pool.used_size() == 0 and not world.ledger.outstanding
    first_key = page_keys(tokens, ps)[0]
    is_damaged = mode in DAMAGING_MODES
    assert world.store.exists(first_key) != is_damaged, "a damaged page was kept"
    slow_prefill(world)
    match = world.match_and_load(tokens)  # the chain starts at the first page
    assert match.num_disk_hit == (0 if is_damaged else 3 * ps)
    world.run(tokens)
    world.check_all()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete"])
def test_prefetch_policies_with_a_stalled_disk(make_world, tmp_path, policy):
    """SGLang's --hicache-storage-prefetch-policy, the disk stalled while a request waits:
    best_effort admits it at once with the pages read by then (none here); wait_complete holds
    it back (``prefetch_ready`` false, for at most WAIT_COMPLETE_MAX_S) until its reads are done,
    then hits the whole prompt. (timeout, the default: test_a_faulty_disk_read_is_a_miss...)"""
    ps = 4
    world = make_world(
        ps, num_slots=16 * ps, disk_dir=tmp_path, fault_mode="ok", prefetch_policy=policy
    )
    tokens = seq(3 * ps)
    world.run(tokens)
    world.flush()
    world.restart(fault_mode="stall", stall_s=30.0)
    world.cache.observe_prefill(len(tokens), 0.6)  # the timeout policy would wait ~0.3 s
    handle = world.cache.prefetch(tokens)
    if policy == "best_effort":
        assert world.cache.prefetch_ready(handle, 0.0)
        started = time.perf_counter()
        match = world.match_and_load(tokens)
        assert time.perf_counter() - started < 0.2 and match.num_disk_hit == 0
        world.faulty.release()
    else:
        assert not world.cache.prefetch_ready(handle, 0.0)
        assert world.cache.prefetch_ready(handle, WAIT_COMPLETE_MAX_S)  # bounded
        world.faulty.release()
        deadline = time.monotonic() + 10.0
        while not world.cache.prefetch_ready(handle, 0.0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert world.cache.prefetch_ready(handle, 0.0)
        match = world.match_and_load(tokens)
        assert (match.matched_len, match.num_disk_hit) == (3 * ps, 3 * ps)
    world.cache.release_prefetch(handle)
    settle(world)
    world.check_all()
    world.run(tokens)
    world.check_all()


def test_prefetch_policy_names_are_checked(make_world, tmp_path):
    with pytest.raises(ValueError, match="prefetch policy"):
        make_world(4, num_slots=16, disk_dir=tmp_path, prefetch_policy="eager")


def test_a_full_disk_stores_nothing_and_breaks_nothing(make_world, tmp_path):
    world = make_world(4, num_slots=64, disk_dir=tmp_path, fault_mode="disk_full")
    tokens = seq(12)
    world.run(tokens)
    world.flush()
    assert world.store.num_pages() == 0
    assert world.cache.storage.stats()["writes_failed"] == 3
    world.check_all()
    world.restart(fault_mode="ok")
    match = world.match_and_load(tokens)
    assert match.matched_len == 0
    world.check_all()


def test_a_stalled_writer_drops_pages_instead_of_queueing_without_bound(make_world, tmp_path):
    page_bytes = 4 * 32  # 4 tokens of 2 layers x (K, V) x 2 float32
    world = make_world(
        4,
        num_slots=64,
        disk_dir=tmp_path,
        fault_mode="stall",
        stall_s=30.0,
        max_pending_write_bytes=3 * page_bytes,
    )
    assert world.host_pool.bytes_per_page == page_bytes
    world.run(seq(12))  # 3 pages queued or being written
    world.run(seq(12, base=100))  # no room in the queue: dropped
    assert world.cache.stats.disk_writes_skipped >= 2
    assert world.cache.storage.pending_write_bytes() <= 3 * page_bytes
    world.faulty.release()
    world.flush()
    world.check_all()
    assert 3 <= world.store.num_pages() < 6


def test_a_host_page_reused_before_the_writer_copies_it_never_reaches_the_disk(
    make_world, tmp_path
):
    """The disk writer writes a page straight from the host pool when it gets to it; a page
    freed and filled with other KV meanwhile (here even while the write is under way) must be
    skipped, not stored under the old key."""
    world = make_world(
        4, num_slots=64, host_tokens=12, disk_dir=tmp_path, fault_mode="stall", stall_s=30.0
    )
    first, second = seq(12), seq(12, base=100)
    world.run(first)  # the writer takes page 0 and stalls; pages 1 and 2 wait in the queue
    deadline = time.monotonic() + 10.0
    while not world.faulty.calls["set"] and time.monotonic() < deadline:
        time.sleep(0.005)
    world.run(second)  # its backup takes the host pages of first, now holding other KV
    world.check_all()
    world.faulty.release()
    world.flush()
    assert world.store.stats()["stale_skipped"] == 1  # page 0: reused during its write
    world.restart()
    slow_prefill(world)
    match = world.match_and_load(first)  # values checked: never second's KV
    assert match.num_disk_hit == 0
    assert world.match_and_load(second).num_disk_hit == 12
    world.check_all()


def test_a_failing_store_never_reaches_the_scheduler(make_world, tmp_path):
    """Every store call raising: inserts, backups, prefetches, loads and evictions go on."""
    world = make_world(
        4, num_slots=32, host_tokens=16, policy="write_back", disk_dir=tmp_path, fault_mode="fail"
    )
    for base in (0, 100, 200):
        tokens = seq(12, base=base)
        world.cache.prefetch(tokens)
        world.run(tokens)
        world.cache.evict(32)
        world.check_all()
    world.flush()
    assert world.store.num_pages() == 0
    match = world.match_and_load(seq(12, base=100))
    assert match.num_host_hit in (0, 12) and match.num_disk_hit == 0
    world.check_all()


def test_pages_of_another_model_never_match(make_world, tmp_path):
    world = make_world(4, num_slots=32, policy="write_through", disk_dir=tmp_path)
    tokens = seq(8)
    world.run(tokens)
    world.flush()
    world.cache.reset()
    world.close()
    other = DiskPageStore(tmp_path, {**FINGERPRINT, "model": "another"}, 1 << 20)
    assert other.num_pages() == 0
    assert not any(other.exists(k) for k in page_keys(tokens, 4))
    other.close()


# ------------------------------------------------------------------------------ namespaces


@pytest.mark.parametrize("page_size", [1, 4])
def test_namespaces_never_cross(make_world, tmp_path, page_size):
    ps = page_size
    world = make_world(ps, num_slots=32 * ps, policy="write_through", disk_dir=tmp_path)
    tokens = seq(4 * ps)
    spaces = [None, "lora-a", "lora-b"]
    for namespace in spaces[:2]:
        world.run(tokens, namespace)
    assert world.match_prefix(tokens, "lora-b").matched_len == 0
    world.cache.evict(world.num_slots)
    for namespace in spaces[:2]:  # each loads its own copy (values checked per namespace)
        assert world.match_and_load(tokens, namespace).num_host_hit == len(tokens)
    assert world.match_and_load(tokens, "lora-b").matched_len == 0
    world.flush()
    world.restart()
    slow_prefill(world)
    for namespace in spaces[:2]:
        assert world.match_and_load(tokens, namespace).num_disk_hit == len(tokens)
    assert world.match_and_load(tokens, "lora-b").matched_len == 0
    world.check_all()


def test_a_disk_hit_survives_host_eviction_emptying_its_namespace(make_world, tmp_path):
    """Reading disk pages into a full host pool evicts the namespace's last host-only node;
    the namespace's root must stay the one the pages are attached to."""
    world = make_world(1, num_slots=16, host_tokens=4, policy="write_through", disk_dir=tmp_path)
    on_disk, in_host = seq(4, base=10), seq(4)
    world.run(on_disk, "lora-a")
    world.flush()
    world.run(in_host, "lora-a")  # its backup pushes on_disk out of the 4-token host pool
    world.cache.evict(16)  # lora-a: one host-only node, and the host pool is full
    assert world.host_pool.available_size() == 0 and tier_profile(
        world.cache, in_host, "lora-a"
    ) == (0, 4)
    slow_prefill(world)
    match = world.match_and_load(on_disk, "lora-a")  # makes room by evicting in_host
    assert match.num_disk_hit == 4
    world.check_all()
    assert device_slots_of(world.cache, on_disk, "lora-a") == match.kv_slots.tolist()


def test_contract_errors(make_world):
    world = make_world(4, num_slots=32)
    with pytest.raises(ValueError):
        world.cache.insert(seq(8), torch.arange(7))
    with pytest.raises(ValueError):
        HiRadixCache(4, world.ledger.free, world.alloc_for_cache, world.controller, None, "lru")
    with pytest.raises(ValueError):
        HiRadixCache(2, world.ledger.free, world.alloc_for_cache, world.controller)
    req = world.admit(seq(8))
    world.insert(req)
    with pytest.raises(RuntimeError):
        world.cache.reset()
    world.release(req)
    world.cache.reset()
    assert not world.ledger.outstanding


@pytest.mark.parametrize("lazy", [False, True], ids=["sync", "lazy"])
def test_write_through_stages_a_leaf_to_disk_without_copying_its_parent_back(
    make_world, tmp_path, lazy
):
    """A host pool smaller than the device pool drops a conversation's host copy; its next
    turn's pages still reach the disk (through host pages nobody keeps, freed once written),
    without the whole history copied back to the host pool first; a restart reads them all."""
    ps = 4
    world = make_world(
        ps, num_slots=32 * ps, host_tokens=8 * ps, disk_dir=tmp_path, lazy_copies=lazy
    )
    first = seq(3 * ps)
    world.run(first)
    if lazy:
        world.engine.finish_all()
    world.flush()
    world.cache._evict_host(world.host_pool.total_size(), set())  # the history's host copy
    assert world.host_pool.used_size() == 0
    written = world.cache.stats.write_back_tokens
    turn = first + seq(2 * ps, base=100)
    world.run(turn)
    assert world.cache.stats.write_back_tokens - written == 2 * ps  # the new turn only
    assert tier_profile(world.cache, first, None) == (3 * ps, 0)  # the history: device only
    world.check_all()  # staged pages are counted as held
    if lazy:
        world.engine.finish_all()
    world.flush()
    world.cache.tier_stats()  # a step: written staged pages go back to the pool
    assert world.host_pool.used_size() == 0 and world.cache.check_tiers_idle()
    assert world.store.num_pages() == len(turn) // ps
    world.restart()
    slow_prefill(world)
    match = world.match_and_load(turn + (999,))  # the values are checked here
    assert match.num_disk_hit == len(turn)
    world.check_all()


def test_a_host_page_whose_read_is_in_flight_is_not_reused_before_the_read_ends(
    make_world, tmp_path
):
    """A prefetch let go while its reads run: pages whose read was not started go back at once;
    a page the reader thread is still filling stays held (the pool cannot hand it out) until the
    read ends, then goes back at the next step."""
    ps = 4
    world = make_world(ps, num_slots=16 * ps, host_tokens=64, disk_dir=tmp_path)
    tokens = seq(6 * ps)
    world.run(tokens)
    spill(world, tokens)
    world.restart(fault_mode="stall", stall_s=30.0)
    disk = world.cache.disk
    handle = world.cache.prefetch(tokens)
    assert disk.num_reserved == 4  # a quarter of the 16 host pages
    deadline = time.monotonic() + 10.0
    while world.faulty.calls["get"] < 2 and time.monotonic() < deadline:  # both readers stalled
        time.sleep(0.005)
    world.cache.release_prefetch(handle)
    world.cache.tier_stats()  # a step: the reads in flight are not done
    assert world.host_pool.used_size() == 2 * ps  # the two pages being read into
    world.check_all()
    taken = world.host_pool.alloc(world.host_pool.available_size())
    assert taken is not None and world.host_pool.alloc(ps) is None  # not handed out
    world.host_pool.free(taken)
    world.faulty.release()
    settle(world)
    assert world.host_pool.used_size() == 0
    world.check_all()
