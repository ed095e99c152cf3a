"""A restarted server is warm for what it served: multi-turn conversations under the default
write policy on a scheduler stepped by hand (tiny random Llama), its device pool a fraction of
the conversations' KV, then a new scheduler over the same disk folder replays them. Before, the
openings churned out of the device before their second hit were never written to disk, nor
what only the device held at the stop: a replay found a quarter of its prefixes."""

from __future__ import annotations

import random

import pytest

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.failures import run_step

pytestmark = pytest.mark.slow  # two schedulers, 36 requests (about 10 s on 2 cores)

POOL = 768
NUM_CONVERSATIONS, NUM_ROUNDS, TURN_LEN, REPLY_LEN = 6, 3, 100, 8
TIER_HITS = ("device_hit_tokens", "host_hit_tokens", "disk_hit_tokens")


def _scheduler(model_dir, store_dir) -> Scheduler:
    return Scheduler(
        config_from_kwargs(
            model_path=str(model_dir),
            log_level="warning",
            max_total_tokens=POOL,
            enable_hierarchical_cache=True,  # the default write policy: write_through_selective
            hicache_storage_dir=str(store_dir),
        )
    )


def _serve(s: Scheduler, rid: str, prompt: list[int]) -> None:
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    s.handle(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params))
    for _ in range(1000):
        if not s.has_work():
            return
        run_step(s)
    raise AssertionError("the scheduler did not finish")


def _conversations(s: Scheduler, seed: int = 0) -> dict[str, int]:
    """Round-robin turns (each prompt the whole history, fixed replies appended); the tier
    counters' change over them."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    turns = [[draw(TURN_LEN) for _ in range(NUM_ROUNDS)] for _ in range(NUM_CONVERSATIONS)]
    replies = [[draw(REPLY_LEN) for _ in range(NUM_ROUNDS)] for _ in range(NUM_CONVERSATIONS)]
    before = s.cache.tier_stats()
    history: list[list[int]] = [[] for _ in range(NUM_CONVERSATIONS)]
    for r in range(NUM_ROUNDS):
        for c in range(NUM_CONVERSATIONS):
            history[c] += turns[c][r]
            _serve(s, f"{c}-{r}", list(history[c]))
            history[c] += replies[c][r]
    after = s.cache.tier_stats()
    keys = ("queried_tokens", *TIER_HITS)
    return {k: after[k] - before[k] for k in keys}


def test_a_restart_replays_the_conversations_it_served_from_its_tiers(
    tiny_llama_dir, tmp_path, tiers_always_load
):
    first = _scheduler(tiny_llama_dir, tmp_path)
    try:
        served = _conversations(first)
        assert first.check_idle()
    finally:
        first.grammars.shutdown()
        first.close()  # what SIGTERM does: flushes the disk tier
    live = NUM_CONVERSATIONS * NUM_ROUNDS * (TURN_LEN + REPLY_LEN)
    assert live > 2 * POOL, "the device pool must churn"
    assert sum(served[k] for k in TIER_HITS) < 0.8 * served["queried_tokens"], served
    s = _scheduler(tiny_llama_dir, tmp_path)  # a restart: device and host tiers empty
    try:
        replay = _conversations(s)
        hits = sum(replay[k] for k in TIER_HITS)
        assert hits >= 0.9 * replay["queried_tokens"], replay
        assert replay["disk_hit_tokens"] > 0, replay
        assert s.check_idle()
        u = s.kv.usage()
        assert u["available"] + u["evictable"] + u["protected"] == POOL, u
    finally:
        s.grammars.shutdown()
        s.close()
