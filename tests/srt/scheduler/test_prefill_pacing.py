"""Prefill pacing (``--tpot-target-ms``, pacing.py): the pacer's credit rule step by step, its
contract on a modelled device (every running request's time per token near the target, the
queue still moving when decoding alone misses it), and in a real scheduler on a virtual clock
(a tiny random Llama on the CPU): a long prompt queue no longer stalls a running request for the
whole queue's prefill, nothing leaks. Greedy outputs with pacing: test_scheduler_equivalence.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler import scheduler as scheduler_module
from radixlm.srt.scheduler.pacing import MIN_PREFILL_SHARE, PrefillPacer
from radixlm.srt.scheduler.prefill import PrefillRate


def _rate(tokens_per_s: float) -> PrefillRate:
    rate = PrefillRate()
    rate.observe(int(tokens_per_s), 1.0)
    return rate


def test_off_or_nothing_running_or_no_rate_keeps_the_whole_budget() -> None:
    off = PrefillPacer(None, 8192, _rate(10000))
    off.begin_step(0.0, 5)
    assert off.budget(8192, 5) == 8192
    on = PrefillPacer(0.05, 8192, _rate(10000))
    on.begin_step(0.0, 0)
    assert on.budget(8192, 0) == 8192  # nobody waits on the step
    unmeasured = PrefillPacer(0.05, 8192)
    unmeasured.begin_step(0.0, 3)
    assert unmeasured.budget(8192, 3) == 8192


def test_decode_steps_earn_the_target_and_a_prefill_spends_its_time() -> None:
    p = PrefillPacer(0.05, 8192, _rate(10000))  # a piece of at least 512 tokens = 51.2 ms
    p.begin_step(0.00, 1)
    assert p.budget(8192, 1) == 0  # nothing earned yet: decode
    p.on_step(decodes=True, prefills=False)
    p.begin_step(0.01, 1)  # a 10 ms decode step earned 40 ms
    assert p.credit_s == pytest.approx(0.04) and p.budget(8192, 1) == 0  # 400 < 512 tokens
    p.on_step(decodes=True, prefills=False)
    p.begin_step(0.02, 1)
    assert p.budget(8192, 1) == 800 and p.budget(300, 1) == 300  # the step's budget caps it
    p.on_step(decodes=False, prefills=True)
    p.begin_step(0.10, 1)  # the 80 ms prefill step
    assert p.credit_s == pytest.approx(0.0)
    p.on_step(decodes=True, prefills=True)  # a mixed step of 70 ms: a token, 20 ms over
    p.begin_step(0.17, 1)
    assert p.credit_s == pytest.approx(-0.02)
    p.begin_step(0.20, 0)  # the running set emptied: nothing owed any more
    assert p.credit_s == 0.0 and p.budget(8192, 0) == 8192


def test_credit_is_capped_at_one_chunk_and_slow_decode_still_earns_a_share() -> None:
    p = PrefillPacer(0.05, 8192, _rate(10000))
    t = 0.0
    for _ in range(100):  # fast decode steps
        p.begin_step(t, 4)
        p.on_step(decodes=True, prefills=False)
        t += 0.001
    p.begin_step(t, 4)
    assert p.credit_s == pytest.approx(8192 / 10000) and p.budget(16384, 4) == 8192
    slow = PrefillPacer(0.05, 8192, _rate(10000))
    slow.begin_step(0.0, 4)
    slow.on_step(decodes=True, prefills=False)
    slow.begin_step(0.2, 4)  # a 200 ms decode step: the target cannot be met by decoding
    share = MIN_PREFILL_SHARE / (1 - MIN_PREFILL_SHARE)
    assert slow.credit_s == pytest.approx(0.2 * share)


def _modelled_run(target_s: float, decode_s: float, seed: int) -> tuple[list, float, float]:
    """A queue of prompts onto a device that prefills 10k tokens/s (2 ms a step) and decodes a
    step in ``decode_s``; the scheduler's part is the pacer's budget alone. Returns per finished
    request (first token time, last token time, tokens), the prefill time and the time until
    the queue emptied."""
    rng = random.Random(seed)
    rate, chunk = 10000.0, 2048
    p = PrefillPacer(target_s, chunk, _rate(rate))
    queue = [[rng.randrange(200, 3000), rng.randrange(20, 200)] for _ in range(40)]
    running: list[dict] = []
    done, t, prefill_s, queue_s = [], 0.0, 0.0, 0.0
    while queue or running:
        had_queue = bool(queue)
        p.begin_step(t, len(running))
        budget = p.budget(min(chunk, queue[0][0]), len(running)) if queue else 0
        if budget:
            queue[0][0] -= budget
            step_s = 0.002 + budget / rate
            prefill_s += step_s
            if queue[0][0] == 0:
                running.append({"left": queue.pop(0)[1], "times": []})
            p.on_step(decodes=False, prefills=True)
        else:
            step_s = decode_s
            for r in running:
                r["left"] -= 1
                r["times"].append(t + step_s)
            done += [r for r in running if r["left"] == 0]
            running = [r for r in running if r["left"] > 0]
            p.on_step(decodes=True, prefills=False)
        t += step_s
        queue_s = t if had_queue else queue_s
    return [(r["times"][0], r["times"][-1], len(r["times"])) for r in done], prefill_s, queue_s


@pytest.mark.parametrize("seed", range(5))
def test_every_running_request_keeps_near_the_target(seed) -> None:
    """Over a request's decode life the prefill stalls are paid by the target's slack: its time
    per token is at most the target plus one chunk's stall (the credit's cap) spread over its
    tokens."""
    target, chunk_s = 0.05, 0.002 + 2048 / 10000
    reqs, _, _ = _modelled_run(target, decode_s=0.01, seed=seed)
    assert len(reqs) == 40
    for first, last, n in reqs:
        assert last - first <= target * (n - 1) + chunk_s + 1e-9


def test_the_queue_moves_when_decoding_alone_misses_the_target() -> None:
    reqs, prefill_s, queue_s = _modelled_run(0.05, decode_s=0.08, seed=1)
    assert len(reqs) == 40
    assert prefill_s / queue_s >= MIN_PREFILL_SHARE


CHUNK = 32
GREEDY = {"temperature": 0, "ignore_eos": True}


def _paced_scheduler(tiny_llama_dir, tmp_path, monkeypatch, **options):
    """A scheduler on a virtual clock: a prefill step costs 1 ms a prompt token, a decode step
    10 ms. Returns it and the list of (clock, decode rows, prefill tokens) per forward."""
    clock = SimpleNamespace(now=0.0)
    fake_time = SimpleNamespace(monotonic=lambda: clock.now, perf_counter=lambda: clock.now)
    monkeypatch.setattr(scheduler_module, "time", fake_time)
    s = Scheduler(
        config_from_kwargs(
            model_path=str(tiny_llama_dir),
            log_level="warning",
            grammar_cache_dir=str(tmp_path),
            max_total_tokens=4096,
            chunked_prefill_size=CHUNK,
            disable_mixed_chunk=True,
            **options,
        )
    )
    seen: list[tuple[float, int, int]] = []
    forward = s.runner.forward

    def on_clock(batch, rows, **kw):
        running = {id(r) for r in s.running}
        decode = [id(r) in running for r in batch.reqs]
        tokens = sum(e for e, d in zip(batch.extend_lens, decode, strict=True) if not d)
        seen.append((clock.now, sum(decode), tokens))
        clock.now += 0.001 * tokens if tokens else 0.010
        return forward(batch, rows, **kw)

    s.runner.forward = on_clock
    return s, seen


def _longest_gap(tiny_llama_dir, tmp_path, monkeypatch, **options) -> tuple[float, int]:
    """A running request, then six 100-token prompts queued behind it: the longest wait of the
    running request between two of its tokens while the queue is prefilled, and the most
    requests running at once."""
    s, seen = _paced_scheduler(tiny_llama_dir, tmp_path, monkeypatch, **options)
    rng = random.Random(5)
    s.handle(TokenizedGenerateReq("long", [rng.randrange(100, 2000) for _ in range(40)],
                                  {**GREEDY, "max_new_tokens": 120}))  # fmt: skip
    for _ in range(4):
        s.step()
    (long,) = s.running
    for i in range(6):
        prompt = [rng.randrange(100, 2000) for _ in range(100)]
        s.handle(TokenizedGenerateReq(f"q{i}", prompt, {**GREEDY, "max_new_tokens": 8}))
    times, most = [scheduler_module.time.monotonic()], 0  # its last token before the queue
    while s.has_work():
        before = len(long.output_ids)
        s.step()
        most = max(most, len(s.running))
        if len(long.output_ids) > before:
            times.append(scheduler_module.time.monotonic())
    assert len(long.output_ids) == 120 and s.check_idle()
    return max(b - a for a, b in zip(times, times[1:], strict=False)), most


def test_a_paced_scheduler_interleaves_the_queue_with_decode(
    tiny_llama_dir, tmp_path, monkeypatch
) -> None:
    unpaced, _ = _longest_gap(tiny_llama_dir, tmp_path, monkeypatch)
    paced, most = _longest_gap(tiny_llama_dir, tmp_path, monkeypatch, tpot_target_ms=50.0)
    assert unpaced >= 0.6  # the whole queue (600 tokens) prefilled before its next token
    assert paced <= CHUNK * 0.001 + 0.010 + 1e-9  # one chunk of stall, then its token
    assert most >= 4  # the queue still joined the running request
