"""The scheduler's load figures (srt/scheduler/reports.py): what they count, that a load query
never settles the step in flight, and the windowed rates behind throughput and cache hits."""

from __future__ import annotations

import random

import pytest

from radixlm.srt.messages import FlushCacheReq, LoadReq, ServerInfoReq, TokenizedGenerateReq
from radixlm.srt.scheduler.reports import WindowedSum

POOL = 2048


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from radixlm.srt import Engine

    eng = Engine(model_path=str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning")
    yield eng
    eng.shutdown()


def load(engine) -> dict:
    reply = engine.scheduler.handle(LoadReq(req_id="q"))
    assert reply.ok
    return reply.data


def request(rid: str, n: int, max_new: int = 4, seed: int = 0) -> TokenizedGenerateReq:
    rng = random.Random(seed)
    ids = [rng.randrange(100, 40000) for _ in range(n)]
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    return TokenizedGenerateReq(rid, ids, params)


def run_until_idle(engine) -> None:
    s = engine.scheduler
    while s.has_work():
        s.step()


def test_idle_load_counts_nothing(engine) -> None:
    engine.flush_cache()
    data = load(engine)
    assert data["num_running_reqs"] == data["num_waiting_reqs"] == 0
    assert data["num_used_tokens"] == data["num_pending_tokens"] == 0
    assert data["max_total_num_tokens"] == POOL
    assert data["max_running_requests"] == engine.config.max_running_requests
    assert data["token_usage"] == data["utilization"] == 0.0


def test_waiting_and_running_requests_and_their_tokens(engine) -> None:
    s = engine.scheduler
    engine.flush_cache()
    s.handle(request("a", 30, seed=1))
    s.handle(request("b", 50, seed=2))
    data = load(engine)
    assert data["num_waiting_reqs"] == 2 and data["num_running_reqs"] == 0
    assert data["num_pending_tokens"] == 80 and data["num_used_tokens"] == 0
    s.step()  # both prefill together
    data = load(engine)
    assert data["num_running_reqs"] == 2 and data["num_waiting_reqs"] == 0
    assert data["num_pending_tokens"] == 0
    # each holds its prompt and the token sampled from it (its KV is written next step)
    assert data["num_used_tokens"] == 30 + 50
    assert data["token_usage"] == round(80 / POOL, 4)
    assert data["utilization"] == round(max(80 / POOL, 2 / s.cfg.max_running_requests), 4)
    run_until_idle(engine)
    data = load(engine)
    assert data["num_running_reqs"] == 0 and data["num_used_tokens"] == 0
    assert data["gen_throughput"] > 0
    assert engine.scheduler.check_idle()


def test_cache_hit_rate_follows_admitted_prompts(engine) -> None:
    s = engine.scheduler
    engine.flush_cache()
    s.stats.prompts.buckets.clear()
    s.handle(request("c1", 40, seed=7))
    run_until_idle(engine)
    assert load(engine)["cache_hit_rate"] == 0.0
    s.handle(request("c2", 40, seed=7))  # the same prompt: all but its last token cached
    run_until_idle(engine)
    assert load(engine)["cache_hit_rate"] == round(39 / 80, 4)


def test_a_load_query_does_not_settle_the_step_in_flight(engine) -> None:
    s = engine.scheduler

    class Unreadable:  # a step in flight that must not be read back
        reqs: list = []

        def read_back(self):
            raise AssertionError("a load query waited for the step in flight")

    s.inflight = Unreadable()
    try:
        assert s.handle(LoadReq(req_id="q")).ok
        with pytest.raises(AssertionError, match="waited"):
            s.handle(ServerInfoReq(req_id="q"))  # other queries report settled state
    finally:
        s.inflight = None


def test_windowed_sum_rate_and_pruning() -> None:
    clock = Clock()
    w = WindowedSum(window_s=10.0, bucket_s=1.0, clock=clock)
    assert w.rate() == 0.0
    clock.now += 2.0
    w.add(10)
    w.add(10)  # the same bucket
    assert len(w.buckets) == 1 and w.rate() == 20 / 2.0  # since start: 2 s
    clock.now += 5.0
    w.add(30, 3)
    assert w.sums() == (50, 3) and w.rate() == 50 / 7.0
    clock.now += 6.0  # the first bucket is 11 s old now
    assert w.sums() == (30, 3) and w.rate() == 30 / 10.0
    for _ in range(1000):
        clock.now += 0.5
        w.add(1)
    assert len(w.buckets) <= 11  # bounded by window / bucket


def test_an_expired_action_is_not_carried_out(engine) -> None:
    """A control message read after its caller gave up (the scheduler was in a long step) is
    answered "expired" and does nothing: the client was told it did not happen."""
    import time

    engine.generate(input_ids=[5, 6, 7, 8, 9, 10], sampling_params={"max_new_tokens": 2})
    cached = engine.scheduler.kv.usage()["evictable"]
    assert cached > 0
    late = FlushCacheReq(req_id="late", expires_at=time.time() - 1)
    reply = engine.scheduler.handle(late)
    assert not reply.ok and "expired" in reply.data["message"]
    assert engine.scheduler.kv.usage()["evictable"] == cached
    reply = engine.scheduler.handle(FlushCacheReq(req_id="ok", expires_at=time.time() + 60))
    assert reply.ok and engine.scheduler.kv.usage()["evictable"] == 0
