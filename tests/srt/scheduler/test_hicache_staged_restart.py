"""The staged write-through and a restart give no-cache's outputs, with a slow disk writer.

Multi-turn conversations (a few requests in flight at once, fixed replies appended) on a
scheduler stepped by hand over a tiny random Llama in float32: write-through with a host pool
half the device pool, so a new turn's parent has lost its host copy and its pages go to disk
through staged host pages; a disk writer that sleeps before every page, so staged and
backed-up host pages are freed and reused while their writes are still queued; then a new
scheduler over the same folder replays the conversations from the disk. Every output token of
both runs must equal the one with no prefix cache at all, and its logprob too up to float32
rounding (a tiny random model's greedy tokens barely depend on the prefix: a page queued before
its copy ran left them unchanged and moved the logprobs by 0.036). Copies run at once, only when
waited for (the latest an asynchronous engine may), or on a GPU (``gpu``: the CUDA copy engine,
a pinned host pool and Triton attention, the path of the H100 multi-turn runs)."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

from radixlm.hicache.disk_store import DiskPageStore
from radixlm.radix.hicache_stats import TierStats
from radixlm.radix.hiradix_cache import HiRadixCache
from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler, cache_factory
from radixlm.srt.scheduler.failures import run_step

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "radix"))
from hiradix_world import LazyCopyEngine  # noqa: E402

pytestmark = pytest.mark.slow  # three schedulers, about 100 requests each

NUM_CONVERSATIONS, NUM_ROUNDS, IN_FLIGHT = 8, 3, 3
REPLY_LEN, OUTPUT_LEN, TURN_PAGES = 6, 4, 5
HOST_RATIO = 0.5
LOGPROB_ABS = 1e-4  # float32 rounding moves them ~1e-6; a wrong page far more
WRITER_DELAY_S = 0.001  # before each page file: the write queue stays behind the tree
SLOW_PREFILL_S = 0.01  # per token, as measured: every load pays off, reads wait long


def _scheduler(model_dir, device: str, page_size: int, pool: int, store_dir=None) -> Scheduler:
    tiers = {}
    if store_dir is not None:
        tiers = dict(
            enable_hierarchical_cache=True,
            hicache_write_policy="write_through",
            hicache_ratio=HOST_RATIO,  # smaller than the device pool: turns are staged
            hicache_storage_dir=str(store_dir),
        )
    return Scheduler(
        config_from_kwargs(
            model_path=str(model_dir),
            device=device,
            dtype="float32",
            log_level="warning",
            max_total_tokens=pool,
            page_size=page_size,
            disable_radix_cache=store_dir is None,
            **tiers,
        )
    )


def _workload(page_size: int, seed: int = 0):
    """Turns of a few pages and a bit, and the fixed replies appended after each round."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(2, 512) for _ in range(n)]  # noqa: E731
    turn_len = TURN_PAGES * page_size + 3
    turns = [[draw(turn_len) for _ in range(NUM_ROUNDS)] for _ in range(NUM_CONVERSATIONS)]
    replies = [[draw(REPLY_LEN) for _ in range(NUM_ROUNDS)] for _ in range(NUM_CONVERSATIONS)]
    return turns, replies


def _serve_all(s: Scheduler, turns, replies) -> dict[tuple[int, int], list[list[float]]]:
    """Each round of every conversation, ``IN_FLIGHT`` requests at a time (admitted, loaded
    and inserted beside each other); the output's [logprob, token id] pairs by (conversation,
    round). The logprobs tell KV apart where a tiny random model's greedy tokens may not."""
    params = {"temperature": 0, "max_new_tokens": OUTPUT_LEN, "ignore_eos": True}
    history: list[list[int]] = [[] for _ in turns]
    outputs: dict[tuple[int, int], list[list[float]]] = {}
    for r in range(NUM_ROUNDS):
        order = list(range(len(turns)))
        random.Random(r).shuffle(order)
        for start in range(0, len(order), IN_FLIGHT):
            for c in order[start : start + IN_FLIGHT]:
                prompt = history[c] + turns[c][r]
                s.handle(
                    TokenizedGenerateReq(
                        rid=f"{c}-{r}",
                        input_ids=prompt,
                        sampling_params=params,
                        return_logprob=True,
                    )
                )
            got: dict[str, list[list[float]]] = {}
            for _ in range(1000):
                out = run_step(s)
                if out is not None:
                    for rid, pairs in zip(out.rids, out.output_token_logprobs, strict=True):
                        got.setdefault(rid, []).extend(pairs or [])
                if not s.has_work():
                    break
            assert not s.has_work(), "the scheduler did not finish"
            for c in order[start : start + IN_FLIGHT]:
                outputs[c, r] = got[f"{c}-{r}"]
        for c in range(len(turns)):
            history[c] += turns[c][r] + replies[c][r]
    return outputs


def _assert_same(got, expected) -> None:
    """Same tokens, and logprobs equal up to float32 rounding under other prefill splits."""
    assert got.keys() == expected.keys()
    for key, pairs in expected.items():
        assert [t for _, t in got[key]] == [t for _, t in pairs], key
        assert [lp for lp, _ in got[key]] == pytest.approx(
            [lp for lp, _ in pairs], abs=LOGPROB_ABS
        ), key


@pytest.fixture
def slow_writer(monkeypatch):
    """Every page file is written ``WRITER_DELAY_S`` late, and prefill is measured slow (so
    the disk hits are loaded, as on a GPU); counts the staged leaves."""
    set_page = DiskPageStore.set
    stage = HiRadixCache._stage_to_disk
    on_prefill = TierStats.on_prefill
    staged = []

    def late_set(self, *args, **kwargs):
        time.sleep(WRITER_DELAY_S)
        return set_page(self, *args, **kwargs)

    def counting_stage(self, node):
        staged.append(len(node.key))
        return stage(self, node)

    def slow_prefill(self, num_tokens, seconds):
        on_prefill(self, num_tokens, num_tokens * SLOW_PREFILL_S)

    monkeypatch.setattr(DiskPageStore, "set", late_set)
    monkeypatch.setattr(TierStats, "on_prefill", slow_prefill)
    monkeypatch.setattr(HiRadixCache, "_stage_to_disk", counting_stage)
    return staged


@pytest.mark.parametrize("copies", ["sync", "lazy", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("page_size", [4, 16])
def test_staged_pages_and_a_restart_give_no_cache_outputs(
    offline_tiny_llama_dir, tmp_path, page_size, copies, slow_writer, monkeypatch
):
    if copies == "lazy":
        monkeypatch.setattr(cache_factory, "SyncCopyEngine", LazyCopyEngine)
    device = "cuda" if copies == "cuda" else "cpu"
    turns, replies = _workload(page_size)
    longest = sum(len(t) + REPLY_LEN for t in turns[0])
    pool = -(-(IN_FLIGHT * (longest + OUTPUT_LEN + page_size)) // page_size) * page_size
    live = NUM_CONVERSATIONS * longest
    assert live > 2 * pool, "the device pool must churn"

    reference = _scheduler(offline_tiny_llama_dir, device, page_size, pool)
    try:
        expected = _serve_all(reference, turns, replies)
    finally:
        reference.close()

    first = _scheduler(offline_tiny_llama_dir, device, page_size, pool, tmp_path)
    try:
        served = _serve_all(first, turns, replies)
        assert first.check_idle()
    finally:
        first.close()  # what SIGTERM does: flushes the disk tier
    assert slow_writer, "no turn was staged to disk"
    _assert_same(served, expected)

    restarted = _scheduler(offline_tiny_llama_dir, device, page_size, pool, tmp_path)
    try:
        replayed = _serve_all(restarted, turns, replies)
        assert restarted.check_idle()
        stats = restarted.cache.tier_stats()
    finally:
        restarted.close()
    assert stats["disk_hit_tokens"] >= live // 4, stats
    _assert_same(replayed, expected)
