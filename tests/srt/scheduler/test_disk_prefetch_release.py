"""Disk-tier reads started for queued requests are let go once those requests are admitted or
aborted (before, an aborted request's pages sat in scheduler memory until /flush_cache).
Scheduler stepped by hand on a tiny random Llama; a restart over the same store directory."""

from __future__ import annotations

import random

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.failures import run_step

POOL = 1024


def _scheduler(model_dir, store_dir) -> Scheduler:
    return Scheduler(
        config_from_kwargs(
            model_path=str(model_dir),
            log_level="warning",
            max_total_tokens=POOL,
            enable_hierarchical_cache=True,
            hicache_write_policy="write_through",
            hicache_storage_dir=str(store_dir),
        )
    )


def _msg(rid: str, prompt: list[int]) -> TokenizedGenerateReq:
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    return TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params)


def _drive(s: Scheduler) -> None:
    for _ in range(1000):
        if not s.has_work():
            return
        run_step(s)
    raise AssertionError("the scheduler did not finish")


def _prefetched(s: Scheduler) -> int:
    return s.cache.tier_stats()["disk_prefetched_pages"]


def test_aborted_and_admitted_requests_let_their_disk_reads_go(
    tiny_llama_dir, tmp_path, tiers_always_load
):
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(200)]
    first = _scheduler(tiny_llama_dir, tmp_path)
    try:
        first.handle(_msg("warm", prompt))
        _drive(first)
    finally:
        first.close()  # flushes the disk writes
    s = _scheduler(tiny_llama_dir, tmp_path)  # a restart: device and host tiers empty
    try:
        ps = s.cache.page_size
        s.handle(_msg("a", prompt + [7]))
        assert _prefetched(s) == len(prompt) // ps
        s.handle(_msg("b", prompt[:120]))  # shares a's first pages
        assert _prefetched(s) == len(prompt) // ps
        s.abort("a")
        assert _prefetched(s) == 119 // ps  # b still waits for its pages
        s.abort("b")
        assert _prefetched(s) == 0
        _drive(s)  # reports the two aborts
        s.handle(_msg("c", prompt + [9]))
        assert _prefetched(s) == len(prompt) // ps
        _drive(s)
        assert _prefetched(s) == 0  # used by the admission, or dropped after it
        assert s.cache.tier_stats()["disk_hit_tokens"] > 0
        assert s.check_idle()
        u = s.kv.usage()
        assert u["available"] + u["evictable"] + u["protected"] == POOL, u
    finally:
        s.grammars.shutdown()
        s.close()
