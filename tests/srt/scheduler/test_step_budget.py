"""The prefill budget of a step (prefill.py ``step_budget``): checked against a brute-force
statement of the rule over a grid of settings, the prefill rate it reads, and in a real
scheduler (a tiny random Llama on the CPU): a step that decodes running requests prefills at
most the mixed cap, a step with nothing to decode the whole chunk, and every running request
gets a token in every step while a long prompt is prefilled."""

from __future__ import annotations

import itertools
import random

import pytest

from radixlm.srt.config import ServerConfig, config_from_kwargs
from radixlm.srt.messages import AbortReq, TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.prefill import (
    PrefillAdmission,
    PrefillRate,
    min_mixed_chunk,
    step_budget,
)


def brute_budget(chunk, max_prefill, decode, cap, target_s, rate) -> int:
    """The largest n the rule allows, found by trying every n from the top."""
    if chunk <= 0:
        return max_prefill
    for n in range(chunk, -1, -1):
        if n > max_prefill:
            continue
        if n > chunk - decode and n > (chunk + 1) // 2:  # decode tokens share the chunk
            continue
        if decode and cap is not None and n > cap:
            continue
        floor = max(64, chunk // 16)  # progress, even when the decode rows miss the target
        if decode and target_s is not None and rate and n > floor:
            if n > rate * target_s:  # a piece over the floor must fit the target
                continue
        return n
    raise AssertionError("some n always fits")


@pytest.mark.parametrize("chunk", [-1, 1, 64, 255, 512, 2048])
def test_step_budget_matches_the_brute_force_rule(chunk) -> None:
    grid = itertools.product(
        [1, 100, 300, 8192],  # max_prefill_tokens
        [0, 1, 40, 200, 600],  # decode tokens in the step
        [None, 1, 50, 1000],  # --mixed-chunk-size
        [None, 0.01, 0.1],  # --mixed-step-target-ms (seconds)
        [None, 1000.0, 3333.3, 1e6, 2e4],  # measured prefill tokens/s
    )
    for max_prefill, decode, cap, target_s, rate in grid:
        got = step_budget(chunk, max_prefill, decode, cap, target_s, rate)
        want = brute_budget(chunk, max_prefill, decode, cap, target_s, rate)
        assert got == want, (chunk, max_prefill, decode, cap, target_s, rate)


def test_the_caps_bound_only_steps_that_decode() -> None:
    assert step_budget(8192, 8192, 0, 2048, 0.04, 40000.0) == 8192  # nothing waits on it
    assert step_budget(8192, 8192, 100, 2048, None, None) == 2048
    assert step_budget(8192, 8192, 100, None, 0.04, 40000.0) == 1600
    assert step_budget(8192, 8192, 100, None, 0.04, None) == 8092  # no rate yet: no bound
    assert min_mixed_chunk(8192) == 512 and min_mixed_chunk(512) == 64
    assert step_budget(8192, 8192, 100, None, 1e-6, 40000.0) == 512  # progress


def test_one_prefill_rate_feeds_the_mixed_target_and_the_ttft_gate() -> None:
    rate = PrefillRate()
    rate.observe(8, 1.0)  # too few tokens to say anything
    assert rate.tokens_per_s is None
    rate.observe(1000, 1.0)
    assert rate.tokens_per_s == 1000
    rate.observe(2000, 1.0)
    assert 1000 < rate.tokens_per_s < 2000
    cfg = ServerConfig(chunked_prefill_size=512, mixed_step_target_ms=100.0)
    adm = PrefillAdmission(cfg, kv=None, stats=None, prefill_rate=rate)
    assert adm.budget(3) == int(rate.tokens_per_s * 0.1) and adm.budget(0) == 512
    fresh = PrefillAdmission(cfg, kv=None, stats=None)
    assert fresh.budget(3) == 509  # nothing measured: only the decode rows' share


def test_a_target_step_converges_to_the_target() -> None:
    """Steps of decode time D plus pieces at R tokens/s, each sized from the rate measured on
    the steps before: the step time tends to the target T (fixed point R * (T - D) tokens),
    whatever the first measurement said (here a cold start 100 times too slow)."""
    big_r, d, t = 40000.0, 0.012, 0.030
    rate = PrefillRate()
    rate.observe(400, 1.0)
    for _ in range(60):
        piece = step_budget(8192, 8192, 50, None, t, rate.tokens_per_s)
        rate.observe(piece, d + piece / big_r)
    assert piece == pytest.approx(big_r * (t - d), rel=0.02)
    assert d + piece / big_r == pytest.approx(t, rel=0.02)


CHUNK = 32
GREEDY = {"temperature": 0, "ignore_eos": True}
RNG = random.Random(3)


def _ids(n: int) -> list[int]:
    return [RNG.randrange(100, 2000) for _ in range(n)]


def test_a_scheduler_caps_mixed_steps_and_keeps_the_chunk_when_nothing_decodes(
    tiny_llama_dir, tmp_path
) -> None:
    s = Scheduler(
        config_from_kwargs(
            model_path=str(tiny_llama_dir),
            log_level="warning",
            grammar_cache_dir=str(tmp_path),
            max_total_tokens=2048,
            chunked_prefill_size=CHUNK,
            mixed_chunk_size=8,
        )
    )
    seen: list[tuple[int, int]] = []  # per forward: (decode rows, prefill tokens)
    forward = s.runner.forward

    def spy(batch, rows, **kw):
        running = {id(r) for r in s.running}
        decode = [id(r) in running for r in batch.reqs]
        tokens = sum(e for e, d in zip(batch.extend_lens, decode, strict=True) if not d)
        seen.append((sum(decode), tokens))
        return forward(batch, rows, **kw)

    s.runner.forward = spy
    s.handle(TokenizedGenerateReq("first", _ids(100), {**GREEDY, "max_new_tokens": 300}))
    while not s.running:
        s.step()
    assert seen == [(0, CHUNK)] * 3 + [(0, 4)]  # nothing decodes: whole chunks
    (first,) = s.running
    s.handle(TokenizedGenerateReq("second", _ids(60), {**GREEDY, "max_new_tokens": 4}))
    seen.clear()
    while len(s.running) == 1:
        before = len(first.output_ids)
        s.step()
        assert len(first.output_ids) == before + 1  # a token in every step
    assert seen == [(1, 8)] * 7 + [(1, 4)]  # 60 tokens in pieces of at most 8
    s.handle(AbortReq(abort_all=True))
    while s.has_work():
        s.step()
    assert s.check_idle()
