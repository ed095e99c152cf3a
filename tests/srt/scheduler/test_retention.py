"""Session-aware retention on a real KVManager (slot allocator, request table, radix cache):
a held session prefix survives a flood of other traffic that evicts everything else; closing,
expiry and a newer turn let it go; the per-session and total bounds hold; running requests
come first when the pool is short; the idle rule holds throughout."""

from __future__ import annotations

import pytest
import torch

from radixlm.radix import make_prefix_cache
from radixlm.srt.executor.memory_pool import ReqToTokenPool, TokenSlotAllocator
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.kv_manager import KVManager
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.retention import PrefixRetention

POOL, PAGE = 256, 4
CPU = torch.device("cpu")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _world(ttl=10.0, max_tokens=96, per_session=64):
    alloc = TokenSlotAllocator(POOL, PAGE, CPU)
    cache = make_prefix_cache(False, PAGE, alloc.free, CPU)
    kv = KVManager(alloc, ReqToTokenPool(8, 512, CPU), cache)
    clock = Clock()
    kv.retention = PrefixRetention(cache, ttl, max_tokens, per_session, clock)
    return kv, kv.retention, clock


def _serve(kv: KVManager, tokens: list[int], session: str | None = None) -> int:
    """One request through admission, prefill and release; its cached tokens. A session turn's
    prefix is held afterwards, as Scheduler._retire does."""
    req = Req(rid="r", prompt_ids=list(tokens), params=SamplingParams())
    prefix = kv.match_and_lock(req)
    assert kv.bind_req_slot(req, prefix)
    cached = req.num_cached_prefix
    assert kv.alloc_tokens(req, len(tokens) - cached) is not None
    req.finish({"type": "length"})
    kv.release(req)
    if session is not None:
        kv.retention.hold(session, req.fill_ids)
    _check_idle(kv)
    return cached


def _check_idle(kv: KVManager) -> None:
    u = kv.usage()
    assert u["available"] + u["evictable"] + u["protected"] == POOL, u
    assert u["protected"] <= kv.retention.held_tokens


def _seq(n: int, base: int) -> list[int]:
    return list(range(base, base + n))


def _flood(kv: KVManager, num: int = 12) -> None:
    """Other traffic: every prompt new, together several times the pool."""
    for i in range(num):
        _serve(kv, _seq(60, 10_000 + 100 * i))


def test_a_held_prefix_survives_a_flood_that_evicts_everything_else():
    kv, ret, _ = _world()
    agent, other = _seq(40, 0), _seq(40, 1000)
    _serve(kv, agent, session="s1")
    _serve(kv, other)  # the same traffic without a hold
    _flood(kv)
    assert _serve(kv, other) == 0
    assert _serve(kv, agent + [7] * 8, session="s1") == 40  # the next turn finds it all
    assert ret.info()["held_sessions"] == 1


def test_close_expiry_and_flush_let_the_prefix_go():
    kv, ret, clock = _world(ttl=10.0)
    _serve(kv, _seq(40, 0), session="s1")
    _serve(kv, _seq(40, 500), session="s2")
    assert kv.cache.protected_size() == 80
    assert ret.release("s1")  # /close_session
    assert not ret.release("s1")
    clock.now = 9.0
    assert ret.expire() == 0
    clock.now = 10.0
    assert ret.expire() == 1  # s2's TTL
    assert kv.cache.protected_size() == 0 and ret.held_tokens == 0
    _flood(kv)
    assert _serve(kv, _seq(40, 0)) == 0  # evicted like any other prefix once let go
    info = ret.info()
    assert (info["released_closed"], info["released_expired"]) == (1, 1)


def test_a_newer_turn_moves_the_hold_to_the_longer_prefix():
    kv, ret, _ = _world(per_session=200, max_tokens=200)
    turn1 = _seq(40, 0)
    _serve(kv, turn1, session="s1")
    _serve(kv, turn1 + _seq(40, 300), session="s1")
    assert ret.held_tokens == 80 and kv.cache.protected_size() == 80
    assert ret.info()["held_sessions"] == 1


def test_the_per_session_and_total_bounds_hold():
    kv, ret, _ = _world(max_tokens=96, per_session=48)
    # 80 cached tokens: the first 48 (the per-session bound, whole pages) are held
    _serve(kv, _seq(80, 0), session="s1")
    assert ret.held_tokens == 48 and kv.cache.protected_size() == 48
    _serve(kv, _seq(40, 600), session="s2")
    assert ret.held_tokens == 88
    _serve(kv, _seq(40, 900), session="s3")  # past 96: the oldest hold (s1) goes
    assert ret.held_tokens == 80 and ret.info()["held_sessions"] == 2
    assert ret.info()["released_for_room"] == 1
    assert kv.cache.protected_size() <= 96


def test_running_requests_come_before_holds_when_the_pool_is_short():
    kv, ret, _ = _world(max_tokens=POOL, per_session=POOL)
    _serve(kv, _seq(120, 0), session="s1")
    _serve(kv, _seq(120, 500), session="s2")
    assert kv.cache.protected_size() == 240
    _serve(kv, _seq(100, 2000))  # needs the slots of one hold
    assert ret.info()["held_sessions"] == 1 and ret.info()["released_for_room"] == 1


def test_off_holds_nothing():
    kv, ret, _ = _world(ttl=0.0)
    _serve(kv, _seq(40, 0), session="s1")
    assert ret.held_tokens == 0 and kv.cache.protected_size() == 0
    with pytest.raises(ValueError):
        PrefixRetention(kv.cache, -1.0, 10, 10)
