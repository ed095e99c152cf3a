"""Overlap scheduling: launching decode step N+1 before step N's tokens are read back changes
nothing a user sees. The bookkeeping (pending output ids, tokens dropped after a finish, aborts
and new arrivals while a step is in flight) runs the same on a CPU, where the "device" copy is
synchronous, so it is checked here against the synchronous scheduler."""

from __future__ import annotations

import random

import pytest

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import AbortReq, TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.scheduler import PENDING_TOKEN

RNG = random.Random(7)
PROMPTS = [[RNG.randrange(100, 40000) for _ in range(n)] for n in (5, 17, 9, 30, 12, 3)]
PARAMS = [
    {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 11, "ignore_eos": True},
    {"temperature": 0.9, "top_p": 0.9, "seed": 5, "max_new_tokens": 8, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True, "stream": True},
    {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True},
]


def _scheduler(model_dir, overlap: bool, **opts) -> Scheduler:
    opts.setdefault("max_total_tokens", 2048)
    s = Scheduler(config_from_kwargs(model_path=str(model_dir), log_level="warning", **opts))
    s.overlap = overlap
    return s


def _submit(s: Scheduler, i: int, params: dict, **extra) -> None:
    params = dict(params)
    stream = params.pop("stream", False)
    s.handle(
        TokenizedGenerateReq(
            rid=f"r{i}", input_ids=PROMPTS[i], sampling_params=params, stream=stream, **extra
        )
    )


def _drain(s: Scheduler, outputs: dict, on_step=None) -> int:
    """Steps until idle; collects every reported token and finish; returns the number of steps
    that left a decode step in flight."""
    in_flight_steps = 0
    while s.has_work():
        out = s.step()
        in_flight_steps += s.inflight is not None
        if on_step is not None:
            on_step(s)
        if out is None:
            continue
        for i, rid in enumerate(out.rids):
            toks, _ = outputs.setdefault(rid, ([], None))
            assert PENDING_TOKEN not in out.new_token_ids[i]
            toks += out.new_token_ids[i]
            outputs[rid] = (toks, out.finish_reason[i] or outputs[rid][1])
    assert s.check_idle()
    return in_flight_steps


def _run_all(model_dir, overlap: bool, late: bool = False, logprob_rid: int | None = None, **opts):
    s = _scheduler(model_dir, overlap, **opts)
    outputs: dict = {}
    first = 3 if late else len(PROMPTS)
    for i in range(first):
        _submit(s, i, PARAMS[i], return_logprob=i == logprob_rid)
    if late:  # the rest arrive while the first ones decode (a step may be in flight)
        for _ in range(4):
            s.step()
        for i in range(first, len(PROMPTS)):
            _submit(s, i, PARAMS[i])
    steps = _drain(s, outputs)
    return s, outputs, steps


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    _, outputs, steps = _run_all(tiny_llama_dir, overlap=False)
    assert steps == 0
    return outputs


def test_overlap_gives_the_same_tokens_and_finishes(tiny_llama_dir, reference):
    s, outputs, steps = _run_all(tiny_llama_dir, overlap=True)
    assert steps > 5  # decode steps really were launched ahead
    assert outputs == reference
    for i, p in enumerate(PARAMS):
        toks, reason = outputs[f"r{i}"]
        assert len(toks) == p["max_new_tokens"] and reason["type"] == "length"


def test_decode_chains_while_requests_wait_that_cannot_be_admitted(tiny_llama_dir, reference):
    """Two running requests at most: the other four wait, but nothing could admit them until
    one finishes, so the next decode step is still launched before the one in flight is read
    back (the waiting queue alone does not stop overlap); the tokens are the same."""
    s = _scheduler(tiny_llama_dir, overlap=True, max_running_requests=2)
    chained_with_waiting = []
    can_chain = s._can_chain_decode

    def spy():
        ok = can_chain()
        chained_with_waiting.append(ok and bool(s.waiting))
        return ok

    s._can_chain_decode = spy
    for i in range(len(PROMPTS)):
        _submit(s, i, PARAMS[i])
    outputs: dict = {}
    _drain(s, outputs)
    assert sum(chained_with_waiting) > 5
    assert outputs == reference


def test_overlap_with_arrivals_mid_decode(tiny_llama_dir):
    _, sync_out, _ = _run_all(tiny_llama_dir, overlap=False, late=True)
    _, overlap_out, steps = _run_all(tiny_llama_dir, overlap=True, late=True)
    assert steps > 0
    # the first three requests' early (non-streamed) steps report nothing; finals must agree
    assert {k: v for k, v in overlap_out.items() if v[1]} == {
        k: v for k, v in sync_out.items() if v[1]
    }


def test_logprob_request_runs_synchronously_with_same_result(tiny_llama_dir, reference):
    s, outputs, _ = _run_all(tiny_llama_dir, overlap=True, logprob_rid=1)
    assert outputs == reference


def test_stop_token_finishes_one_step_late_without_leaking_the_extra_token(
    tiny_llama_dir, reference
):
    stop_at = reference["r1"][0][4]  # r1's fifth greedy token
    params = {"temperature": 0, "max_new_tokens": 11, "stop_token_ids": [stop_at]}
    s = _scheduler(tiny_llama_dir, overlap=True)
    s.handle(TokenizedGenerateReq(rid="r1", input_ids=PROMPTS[1], sampling_params=params))
    outputs: dict = {}
    _drain(s, outputs)
    toks, reason = outputs["r1"]
    first = reference["r1"][0].index(stop_at)
    assert toks == reference["r1"][0][: first + 1]
    assert reason["type"] == "stop"


def test_abort_while_a_step_is_in_flight(tiny_llama_dir):
    s = _scheduler(tiny_llama_dir, overlap=True)
    for i in (1, 4, 5):
        _submit(s, i, PARAMS[i])
    outputs: dict = {}
    aborted = []

    def abort_once(sched):
        if sched.inflight is not None and not aborted:
            aborted.append(True)
            sched.handle(AbortReq(rid="r4"))

    _drain(s, outputs, on_step=abort_once)
    assert aborted
    assert outputs["r4"][1]["type"] == "abort"
    assert outputs["r1"][1]["type"] == "length" and len(outputs["r1"][0]) == 11
    info = s.server_info()
    assert info["available"] + info["evictable"] + info["protected"] == info["max_total_tokens"]


def test_paced_prefill_chains_decode_while_admissible_requests_wait(tiny_llama_dir):
    """With a 1 ms TPOT target (CPU decode steps are slower: the pacer grants prompts a share
    only now and then) requests that could be admitted wait while decode steps chain; the
    final tokens are those of the synchronous, unpaced scheduler."""
    _, sync_out, _ = _run_all(tiny_llama_dir, overlap=False, late=True)
    s = _scheduler(tiny_llama_dir, overlap=True, tpot_target_ms=1.0, disable_mixed_chunk=True)
    paced_chains = []
    can_chain = s._can_chain_decode

    def spy():
        ok = can_chain()
        admissible = bool(s.waiting) and not s.admission.blocked(s.waiting, s.running)
        paced_chains.append(ok and admissible)
        return ok

    s._can_chain_decode = spy
    for i in range(3):
        _submit(s, i, PARAMS[i])
    for _ in range(4):
        s.step()
    for i in range(3, len(PROMPTS)):
        _submit(s, i, PARAMS[i])
    outputs: dict = {}
    _drain(s, outputs)
    assert any(paced_chains)
    assert {k: v for k, v in outputs.items() if v[1]} == {k: v for k, v in sync_out.items() if v[1]}
