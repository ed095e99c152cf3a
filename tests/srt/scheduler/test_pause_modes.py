"""SGLang's pause modes inside the scheduler: ``in_place`` stops batches and keeps every request
with its KV; ``retract`` sends the running requests (and a prompt between two chunks) back to
the waiting queue with their KV released. Either way nothing runs until ``continue``, aborts
are still reported, the outputs equal an unpaused run's, and a weight update may run while
paused (``in_place`` only without emptying the cache). Scheduler stepped by hand on a tiny
random Llama; no KV, request row or request state left afterwards."""

from __future__ import annotations

import random

import pytest

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import (
    AbortReq,
    ContinueReq,
    PauseReq,
    TokenizedGenerateReq,
    UpdateWeightsFromDiskReq,
)
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.failures import run_step

POOL = 4096


@pytest.fixture(scope="module")
def sched(tiny_llama_dir):
    cfg = config_from_kwargs(
        model_path=str(tiny_llama_dir),
        log_level="warning",
        max_total_tokens=POOL,
        chunked_prefill_size=64,
    )
    s = Scheduler(cfg)
    yield s
    s.grammars.shutdown()


@pytest.fixture(autouse=True)
def leak_free(sched):
    yield
    sched.paused = None
    assert not sched.has_work()
    u = sched.kv.usage()
    assert u["available"] + u["evictable"] + u["protected"] == POOL and u["protected"] == 0, u
    assert sched.check_idle()
    sched.cache.reset()


def _msgs(tag: str) -> list[TokenizedGenerateReq]:
    rng = random.Random(7)
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    lens = (20, 33, 150)  # the last one is prefilled in three chunks of 64
    return [
        TokenizedGenerateReq(f"{tag}{i}", [rng.randrange(100, 40000) for _ in range(n)], params)
        for i, n in enumerate(lens)
    ]


def _collect(out, ids: dict, reasons: dict) -> None:
    for i, rid in enumerate(out.rids if out else []):
        assert rid not in reasons, f"{rid} reported after its finish"
        ids.setdefault(rid, []).extend(out.new_token_ids[i])
        if out.finish_reason[i] is not None:
            reasons[rid] = out.finish_reason[i]


def _run(s: Scheduler, msgs, pause_at: int | None = None, mode: str = "", while_paused=None):
    """Steps until idle; pauses after ``pause_at`` steps, calls ``while_paused(s)``, resumes.
    Per rid (output ids, finish reason)."""
    for m in msgs:
        s.handle(m)
    ids: dict = {}
    reasons: dict = {}
    step = 0
    while s.wants_step():
        _collect(run_step(s), ids, reasons)
        step += 1
        if step == pause_at:
            reply = s.handle(PauseReq(mode, req_id="p"))
            assert reply.ok, reply.data
            assert not s.wants_step() or s.finished_outside_step
            if while_paused is not None:
                while_paused(s, ids, reasons)
            assert s.handle(ContinueReq(req_id="c")).ok
        assert step < 5000
    return {rid: (ids.get(rid, []), reasons.get(rid)) for rid in set(ids) | set(reasons)}


def _tokens_held(s: Scheduler) -> int:
    u = s.kv.usage()
    return u["max_total_tokens"] - u["available"] - u["evictable"]


def test_unknown_mode_is_refused(sched) -> None:
    reply = sched.handle(PauseReq("freeze", req_id="p"))
    assert not reply.ok and "in_place or retract" in reply.data["message"]
    assert sched.paused is None


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_pause_holds_everything_and_the_outputs_are_unchanged(sched, mode) -> None:
    want = _run(sched, _msgs("a"))
    sched.cache.reset()

    def paused(s, ids, reasons):
        held = _tokens_held(s)
        if mode == "retract":
            assert not s.running and s.chunked is None and len(s.waiting) == 3
            assert held == 0  # every request's KV went back
        else:
            assert held > 0 and (s.running or s.chunked is not None)
        before = {rid: list(v) for rid, v in ids.items()}
        for _ in range(3):  # the loop would not step; a step anyway schedules nothing
            assert not s.wants_step()
            _collect(run_step(s), ids, reasons)
        assert ids == before and _tokens_held(s) == held

    got = _run(sched, _msgs("a"), pause_at=3, mode=mode, while_paused=paused)
    assert got == want


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_an_abort_while_paused_is_reported_and_released(sched, mode) -> None:
    def paused(s, ids, reasons):
        s.handle(AbortReq("b1"))
        assert s.wants_step()  # to report it
        _collect(run_step(s), ids, reasons)
        assert reasons["b1"]["type"] == "abort"
        assert not s.wants_step()

    got = _run(sched, _msgs("b"), pause_at=2, mode=mode, while_paused=paused)
    assert got["b0"][1]["type"] == got["b2"][1]["type"] == "length"


def test_weight_updates_while_paused(sched, tiny_llama_dir) -> None:
    path = str(tiny_llama_dir)

    def in_place(s, ids, reasons):
        reply = s.handle(UpdateWeightsFromDiskReq(path, req_id="u"))
        assert not reply.ok and "flush_cache: false" in reply.data["message"]
        assert not reply.data.get("busy")
        assert s.handle(UpdateWeightsFromDiskReq(path, flush_cache=False, req_id="u")).ok

    got = _run(sched, _msgs("c"), pause_at=2, mode="in_place", while_paused=in_place)
    assert all(r[1]["type"] == "length" for r in got.values())

    def retract(s, ids, reasons):
        reply = s.handle(UpdateWeightsFromDiskReq(path, req_id="u"))
        assert reply.ok, reply.data
        assert s.kv.usage()["evictable"] == 0  # the cache was emptied

    got = _run(sched, _msgs("d"), pause_at=2, mode="retract", while_paused=retract)
    assert all(r[1]["type"] == "length" for r in got.values())


def test_a_retracted_chunked_prompt_keeps_one_input_logprob_per_position(sched) -> None:
    """Retracted between two chunks, a prompt is prefilled again from the start: its input
    logprobs are the unpaused run's, one per position (the first chunk's rows are replaced)."""

    def run(pause_at):
        rng = random.Random(3)
        msg = TokenizedGenerateReq(
            "lp",
            [rng.randrange(100, 40000) for _ in range(150)],
            {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
        )
        sched.handle(msg)
        rows, tops, step = None, None, 0
        while sched.wants_step():
            out = run_step(sched)
            for i, rid in enumerate(out.rids if out else []):
                if rid == "lp" and out.input_token_logprobs[i] is not None:
                    rows, tops = out.input_token_logprobs[i], out.input_top_logprobs[i]
            step += 1
            if step == pause_at:
                assert sched.chunked is not None  # between two chunks
                assert sched.handle(PauseReq("retract", req_id="p")).ok
                assert sched.chunked is None
                assert sched.handle(ContinueReq(req_id="c")).ok
        sched.cache.reset()
        return rows, tops

    ref_rows, ref_tops = run(None)
    rows, tops = run(1)
    assert len(ref_rows) == len(rows) == 150 and len(tops) == 150
    assert [t for _, t in rows] == [t for _, t in ref_rows]
    for (a, _), (b, _) in zip(rows[1:], ref_rows[1:], strict=True):
        assert abs(a - b) < 1e-4
