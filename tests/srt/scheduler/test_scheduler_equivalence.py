"""Greedy outputs do not depend on how the scheduler gets there: prefix cache on or off, chunked
prefill on or off, forced retraction, under each scheduling policy."""

from __future__ import annotations

import logging
import random

import pytest

POLICIES = ("fcfs", "lpm", "dfs-weight")
SHARED_LEN = 34  # above the in-batch sharing threshold, so later requests of a group hit the cache
PROMPT_LEN = 40
OUTPUT_LEN = 40
NUM_PROMPTS = 8
GREEDY = {"temperature": 0, "max_new_tokens": OUTPUT_LEN, "ignore_eos": True}
RETRACT_POOL = 300  # 8 requests of 40 + 40 tokens need 640 slots: decode must retract


def _workload() -> list[list[int]]:
    """Eight prompts in three groups; each group shares a 34-token prefix."""
    rng = random.Random(1234)
    heads = [[rng.randrange(100, 40000) for _ in range(SHARED_LEN)] for _ in range(3)]
    tail = PROMPT_LEN - SHARED_LEN
    return [
        heads[i % 3] + [rng.randrange(100, 40000) for _ in range(tail)] for i in range(NUM_PROMPTS)
    ]


PROMPTS = _workload()


def run_workload(model_dir, info_out=None, **options) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs and cached-token counts of the workload on a fresh engine; checks that
    the engine is idle and leak-free afterwards (its server info goes into ``info_out``)."""
    from radixlm.srt import Engine

    engine = Engine(model_path=str(model_dir), log_level="warning", **options)
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        info = engine.get_server_info()
        if info_out is not None:
            info_out.update(info)
        assert engine.scheduler.check_idle()
        assert info["available"] + info["evictable"] + info["protected"] == info["max_total_tokens"]
        engine.scheduler.cache.check_integrity()
    finally:
        engine.shutdown()
    assert all(o["meta_info"]["completion_tokens"] == OUTPUT_LEN for o in outs)
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    """No cache, no chunking, a pool large enough that nothing is ever retracted."""
    outputs, cached = run_workload(tiny_llama_dir, max_total_tokens=4096, disable_radix_cache=True)
    assert cached == [0] * NUM_PROMPTS
    assert len({tuple(o) for o in outputs}) > 1  # the outputs tell the prompts apart
    return outputs


@pytest.mark.parametrize("policy", POLICIES)
def test_radix_cache_on_gives_the_same_greedy_outputs(tiny_llama_dir, reference, policy):
    outputs, cached = run_workload(tiny_llama_dir, max_total_tokens=4096, schedule_policy=policy)
    assert sum(cached) >= SHARED_LEN * (NUM_PROMPTS - 3)  # the cache was really used
    assert outputs == reference


@pytest.mark.parametrize("policy", POLICIES)
def test_chunked_prefill_gives_the_same_greedy_outputs(tiny_llama_dir, reference, policy):
    outputs, _ = run_workload(
        tiny_llama_dir, max_total_tokens=4096, schedule_policy=policy, chunked_prefill_size=16
    )
    assert outputs == reference


def test_chunked_prefill_without_cache_gives_the_same_greedy_outputs(tiny_llama_dir, reference):
    outputs, _ = run_workload(
        tiny_llama_dir, max_total_tokens=4096, chunked_prefill_size=16, disable_radix_cache=True
    )
    assert outputs == reference


def _retractions(caplog) -> int:
    return sum("retract" in r.getMessage().lower() for r in caplog.records)


@pytest.mark.parametrize("policy", POLICIES)
def test_forced_retraction_gives_the_same_greedy_outputs(tiny_llama_dir, reference, policy, caplog):
    caplog.set_level(logging.INFO, logger="radixlm.srt.scheduler")
    outputs, _ = run_workload(
        tiny_llama_dir,
        max_total_tokens=RETRACT_POOL,
        schedule_policy=policy,
        schedule_conservativeness=0,  # admit while the pool has room: decode must retract
    )
    assert _retractions(caplog) > 0, "the pool was meant to be too small for every request at once"
    assert outputs == reference


def test_forced_retraction_without_cache_gives_the_same_greedy_outputs(
    tiny_llama_dir, reference, caplog
):
    caplog.set_level(logging.INFO, logger="radixlm.srt.scheduler")
    outputs, _ = run_workload(
        tiny_llama_dir,
        max_total_tokens=RETRACT_POOL,
        disable_radix_cache=True,
        chunked_prefill_size=16,
        schedule_conservativeness=0,
    )
    assert _retractions(caplog) > 0
    assert outputs == reference


def test_admission_keeps_room_for_the_running_requests_output(tiny_llama_dir, reference):
    """A pool of 400 slots for eight requests of 40 + 40 tokens (no prefix cache): admitting
    every prompt at once (conservativeness 0) leaves decode short and retracts (their prefill
    is computed again); the default reserve (0.7 of each running request's remaining output)
    admits five, whose outputs fit beside each other, and retracts none. Same greedy outputs
    either way. (With the prefix cache the shared prefixes let all eight in under the 0.7 bet,
    and running every request to its limit retracts as often as without the reserve.)"""
    opts = dict(max_total_tokens=400, disable_radix_cache=True)
    greedy_info, careful_info = {}, {}
    greedy, _ = run_workload(tiny_llama_dir, greedy_info, schedule_conservativeness=0, **opts)
    careful, _ = run_workload(tiny_llama_dir, careful_info, **opts)
    assert greedy == reference and careful == reference
    assert greedy_info["num_retractions"] > 0
    assert careful_info["num_retractions"] == 0
    assert 0 < careful_info["new_token_ratio"] < 0.7  # decayed over the decode steps


def test_paced_prefill_gives_the_same_greedy_outputs(tiny_llama_dir, reference, monkeypatch):
    """A 1 ms TPOT target on a CPU (slower decode steps than that: prompts get the pacer's
    minimum share, so the queue joins between decode steps) changes order and batching only."""
    from radixlm.srt.scheduler.pacing import PrefillPacer

    paced = []
    budget = PrefillPacer.budget

    def spy(self, budget_tokens, num_running):
        out = budget(self, budget_tokens, num_running)
        paced.append(out < budget_tokens)
        return out

    monkeypatch.setattr(PrefillPacer, "budget", spy)
    outputs, _ = run_workload(
        tiny_llama_dir,
        max_total_tokens=4096,
        chunked_prefill_size=16,
        disable_mixed_chunk=True,
        tpot_target_ms=1.0,
    )
    assert outputs == reference
    assert any(paced)  # some steps decoded, or prefilled less, while prompts waited
