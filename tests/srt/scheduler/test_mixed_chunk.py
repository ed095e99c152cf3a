"""Mixed chunked prefill: a step that prefills a chunk also decodes every running request.

Checked against the scheduler without chunking: the same greedy tokens, logprobs and grammar
outputs for requests arriving while others decode (some prompts many chunks long), for page
sizes 1 and 16 and under forced retraction; a running request gets a token in every step while
a long prompt is chunked (and none without mixing); idle means leak-free."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import AbortReq, TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler

CHUNK = 16
RNG = random.Random(5)


def _ids(n: int) -> list[int]:
    return [RNG.randrange(100, 40000) for _ in range(n)]


GREEDY = {"temperature": 0, "ignore_eos": True}
# (rid, prompt, sampling params, extra request fields, step at which it arrives)
WORKLOAD = [
    ("s0", _ids(5), {**GREEDY, "max_new_tokens": 40}, {}, 0),
    ("s1", _ids(9), {**GREEDY, "max_new_tokens": 30}, {"return_logprob": True}, 0),
    ("s2", _ids(13), {"temperature": 0, "max_new_tokens": 30, "regex": r"[a-z]{8,20}"}, {}, 1),
    ("l0", _ids(90), {**GREEDY, "max_new_tokens": 8}, {}, 3),
    ("s3", _ids(7), {**GREEDY, "max_new_tokens": 3}, {}, 4),  # finishes in a mixed step
    ("l1", _ids(150), {**GREEDY, "max_new_tokens": 6}, {"top_logprobs_num": 2}, 6),
    ("s4", _ids(11), {**GREEDY, "max_new_tokens": 12}, {"return_logprob": True}, 8),
]


def _scheduler(model_dir, tmp_path, **opts) -> Scheduler:
    opts.setdefault("max_total_tokens", 2048)
    return Scheduler(
        config_from_kwargs(
            model_path=str(model_dir),
            log_level="warning",
            grammar_cache_dir=str(tmp_path),
            **opts,
        )
    )


def _submit(s: Scheduler, rid: str, prompt, params, extra) -> None:
    if extra.get("top_logprobs_num"):
        extra = {"return_logprob": True, **extra}
    s.handle(TokenizedGenerateReq(rid, prompt, dict(params), **extra))


def _record_forwards(s: Scheduler) -> list[tuple[int, int]]:
    """Wraps the runner's forward: per forward, (decode rows, prefill rows) of the batch."""
    seen: list[tuple[int, int]] = []
    forward = s.runner.forward

    def spy(batch, rows, **kw):
        running = {id(r) for r in s.running}
        decode = sum(id(r) in running for r in batch.reqs)
        seen.append((decode, len(batch.reqs) - decode))
        return forward(batch, rows, **kw)

    s.runner.forward = spy
    return seen


def run(s: Scheduler, workload=WORKLOAD) -> dict[str, dict]:
    """Drives the workload to the end; per rid its tokens, finish reason and output logprobs."""
    got: dict[str, dict] = {}
    step = 0
    while step == 0 or s.has_work():
        for rid, prompt, params, extra, at in workload:
            if at == step:
                _submit(s, rid, prompt, params, extra)
        out = s.step()
        step += 1
        for i, rid in enumerate(out.rids if out is not None else []):
            r = got.setdefault(rid, {"ids": [], "reason": None, "logprobs": [], "top": []})
            r["cached"] = out.cached_tokens[i]
            r["ids"] += out.new_token_ids[i]
            r["reason"] = out.finish_reason[i] or r["reason"]
            r["logprobs"] += [lp for lp, _ in out.output_token_logprobs[i] or []]
            r["top"] += [[t for _, t in pos] for pos in out.output_top_logprobs[i] or []]
        assert step < 2000, "the scheduler did not finish"
    assert s.check_idle()
    s.cache.check_integrity()
    return got


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid]["ids"] == want[rid]["ids"], rid
        assert got[rid]["reason"] == want[rid]["reason"], rid
        assert got[rid]["top"] == want[rid]["top"], rid
        assert got[rid]["logprobs"] == pytest.approx(want[rid]["logprobs"], abs=1e-4), rid


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory) -> dict[str, dict]:
    """No chunking: every prompt is prefilled in one step, decodes wait for it."""
    s = _scheduler(tiny_llama_dir, tmp_path_factory.mktemp("g"), chunked_prefill_size=-1)
    want = run(s)
    assert [len(want[rid]["ids"]) for rid in ("s0", "l0", "s3", "l1")] == [40, 8, 3, 6]
    assert len(want["s1"]["logprobs"]) == 30 and len(want["l1"]["top"]) == 6
    assert want["s2"]["reason"]["type"] == "stop" and len(want["s2"]["ids"]) > 2  # then EOS
    return want


@pytest.mark.parametrize("page_size", [pytest.param(1, marks=pytest.mark.slow), 16])
def test_mixed_chunks_give_the_unchunked_outputs(tiny_llama_dir, tmp_path, reference, page_size):
    s = _scheduler(tiny_llama_dir, tmp_path, chunked_prefill_size=CHUNK, page_size=page_size)
    assert s.admission.mixes
    forwards = _record_forwards(s)
    _assert_same(run(s), reference)
    mixed = [f for f in forwards if f[0] and f[1]]
    assert len(mixed) >= (90 + 150) // CHUNK, forwards  # every chunk of l0 and l1 decoded too


def test_mixed_chunks_under_forced_retraction(tiny_llama_dir, tmp_path, reference, caplog):
    caplog.set_level(logging.INFO, logger="radixlm.srt.scheduler")
    s = _scheduler(
        tiny_llama_dir,
        tmp_path,
        chunked_prefill_size=CHUNK,
        max_total_tokens=200,
        schedule_conservativeness=0,  # admit while the pool has room: decode must retract
    )
    _assert_same(run(s), reference)
    assert any("retract" in r.getMessage().lower() for r in caplog.records)
    assert s.num_retractions > 0


def test_unmixed_chunks_give_the_unchunked_outputs(tiny_llama_dir, tmp_path, reference):
    s = _scheduler(tiny_llama_dir, tmp_path, chunked_prefill_size=CHUNK, disable_mixed_chunk=True)
    assert not s.admission.mixes
    forwards = _record_forwards(s)
    _assert_same(run(s), reference)
    assert not [f for f in forwards if f[0] and f[1]]


def _steps_while_chunking(s: Scheduler, prompt_len: int) -> tuple[int, int]:
    """One request decoding, then a ``prompt_len``-token prompt arrives: the number of steps
    until that prompt is prefilled, and how many of them gave the running request a token."""
    s.handle(TokenizedGenerateReq("run", _ids(4), {**GREEDY, "max_new_tokens": 200}))
    s.step()
    s.step()
    (running,) = s.running
    s.handle(TokenizedGenerateReq("long", _ids(prompt_len), {**GREEDY, "max_new_tokens": 4}))
    steps = with_token = 0
    while len(s.running) == 1:  # "long" joins the running list once its prefill completes
        before = len(running.output_ids)
        s.step()
        steps += 1
        with_token += len(running.output_ids) == before + 1
    s.handle(AbortReq(abort_all=True))
    while s.has_work():
        s.step()
    assert s.check_idle()
    return steps, with_token


@pytest.mark.parametrize("mixed", [True, False])
def test_a_running_decode_gets_a_token_in_every_chunk_step(tiny_llama_dir, tmp_path, mixed):
    s = _scheduler(
        tiny_llama_dir, tmp_path, chunked_prefill_size=CHUNK, disable_mixed_chunk=not mixed
    )
    steps, with_token = _steps_while_chunking(s, 300)
    if mixed:
        # the decode token takes one token of each chunk's budget
        assert steps == -(-300 // (CHUNK - 1))
        assert with_token == steps
    else:
        assert steps == -(-300 // CHUNK)
        assert with_token == 0  # every chunk runs before decoding resumes


def _gpu_workload(vocab_size: int) -> list:
    rng = random.Random(9)
    ids = [[rng.randrange(2, vocab_size) for _ in range(n)] for n in (6, 11, 300, 9, 180)]
    return [
        ("g0", ids[0], {**GREEDY, "max_new_tokens": 60}, {}, 0),
        ("g1", ids[1], {**GREEDY, "max_new_tokens": 50}, {"return_logprob": True}, 0),
        ("g2", ids[2], {**GREEDY, "max_new_tokens": 5}, {}, 4),
        ("g3", ids[3], {**GREEDY, "max_new_tokens": 4}, {}, 6),
        ("g4", ids[4], {**GREEDY, "max_new_tokens": 7}, {"top_logprobs_num": 3}, 9),
    ]


@pytest.mark.gpu
def test_gpu_mixed_chunks_with_overlap_give_the_unchunked_outputs(tmp_path):
    """On a GPU decode steps between prefills run ahead (overlap scheduling, CUDA graphs); a
    prefill settles the step in flight first and then carries the decodes."""
    from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder

    shape = TINY_LLAMA
    folder = make_model_folder(tmp_path / "tiny", shape)
    workload = _gpu_workload(shape["vocab_size"])
    results = []
    for chunk in (-1, 32):
        torch.manual_seed(0)  # the dummy weights
        s = _scheduler(
            folder,
            tmp_path,
            load_format="dummy",
            attention_backend="triton",
            dtype="float32",
            chunked_prefill_size=chunk,
            enable_mixed_chunk=True,  # off by default on a GPU
        )
        assert s.overlap and s.admission.mixes is (chunk > 0)
        forwards = _record_forwards(s)
        results.append(run(s, workload))
    _assert_same(results[1], results[0])
    assert len([f for f in forwards if f[0] and f[1]]) >= (300 + 180) // 32


@pytest.mark.parametrize("mixed", [True, False])
def test_a_prompt_between_chunks_gives_its_slots_back_before_a_decode_is_cut(
    tiny_llama_dir, tmp_path, mixed
):
    """A long prompt admitted while another request decodes fills the pool chunk by chunk;
    when decode runs short, the prompt between chunks is retracted (it loses no output and
    prefills again later), never the decoding request ended early as "length" (b stopped at
    91 of 150 tokens before)."""
    workload = [
        ("b", _ids(40), {**GREEDY, "max_new_tokens": 150}, {}, 0),
        ("a", _ids(296), {**GREEDY, "max_new_tokens": 4}, {}, 60),
    ]
    s = _scheduler(
        tiny_llama_dir,
        tmp_path,
        chunked_prefill_size=CHUNK,
        max_total_tokens=400,  # b alone needs 190, a alone 300; both at once do not fit
        schedule_conservativeness=0,  # admit a while the pool has room
        disable_mixed_chunk=not mixed,
    )
    got = run(s, workload)
    assert got["b"]["reason"] == {"type": "length", "length": 150}
    assert len(got["b"]["ids"]) == 150
    assert got["a"]["reason"]["type"] == "length" and len(got["a"]["ids"]) == 4
    if mixed:  # b decodes between a's chunks until the pool runs short: a gives way
        assert s.num_retractions > 0
    # a's own chunks, cached when it gave way, are not prompt tokens served from the cache
    assert got["a"]["cached"] == 0 and s.stats.totals["num_admitted_reqs"] == 2
