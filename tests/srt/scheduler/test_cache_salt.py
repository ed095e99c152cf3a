"""``cache_salt``: cached prefixes are shared only between requests with the same salt, on the
device, in host memory and on disk, before and after a restart (a scheduler stepped by hand on
a tiny random Llama; hits read from the tiers' counters)."""

from __future__ import annotations

import random

import pytest

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.managers.generate_call import GenerateCall, split_call
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.failures import run_step

POOL = 1024
TIER_HITS = ("device_hit_tokens", "host_hit_tokens", "disk_hit_tokens")
PROMPT = [random.Random(0).randrange(100, 40000) for _ in range(200)]


def _scheduler(model_dir, store_dir) -> Scheduler:
    return Scheduler(
        config_from_kwargs(
            model_path=str(model_dir),
            log_level="warning",
            max_total_tokens=POOL,
            enable_hierarchical_cache=True,
            hicache_write_policy="write_through",  # every prefix has a host copy at once
            hicache_storage_dir=str(store_dir),
        )
    )


def _hits(s: Scheduler, salt: str | None, rid: str) -> dict[str, int]:
    """Serves PROMPT (plus one token) with ``salt``; the hit tokens per tier it got."""
    before = s.cache.tier_stats()
    params = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    msg = TokenizedGenerateReq(rid, PROMPT + [7], params, cache_salt=salt)
    s.handle(msg)
    for _ in range(100):
        if not s.has_work():
            break
        run_step(s)
    after = s.cache.tier_stats()
    return {k.split("_")[0]: after[k] - before[k] for k in TIER_HITS}


def _close(s: Scheduler) -> None:
    assert s.check_idle()
    s.grammars.shutdown()
    s.close()


@pytest.mark.slow  # two schedulers on a tiny model (about 5 s on 2 cores)
def test_no_prefix_is_shared_across_salts_in_any_tier(tiny_llama_dir, tmp_path, tiers_always_load):
    none = {"device": 0, "host": 0, "disk": 0}
    s = _scheduler(tiny_llama_dir, tmp_path)
    try:
        assert _hits(s, "tenant-a", "a1") == none
        assert _hits(s, "tenant-b", "b1") == none  # device: a's prefix is not b's
        assert _hits(s, None, "n1") == none
        assert _hits(s, "tenant-a", "a2")["device"] == 192
        s.cache.evict(POOL)  # every prefix leaves the device: host copies only
        assert _hits(s, "tenant-c", "c1") == none  # host: nothing of a, b or the unsalted
        assert _hits(s, "tenant-b", "b2")["host"] == 192
    finally:
        _close(s)
    s = _scheduler(tiny_llama_dir, tmp_path)  # a restart: the disk tier alone is warm
    try:
        assert _hits(s, "tenant-d", "d1") == none
        assert _hits(s, "tenant-a", "a3")["disk"] == 192
        assert _hits(s, None, "n2")["disk"] == 192
    finally:
        _close(s)


def test_a_batch_takes_one_salt_or_one_per_prompt():
    call = GenerateCall(input_ids=[[1, 2], [3, 4]], cache_salt=["x", None])
    inputs, _ = split_call(call)
    assert [i.cache_salt for i in inputs] == ["x", None]
    inputs, _ = split_call(GenerateCall(input_ids=[[1, 2], [3, 4]], cache_salt="y"))
    assert [i.cache_salt for i in inputs] == ["y", "y"]
