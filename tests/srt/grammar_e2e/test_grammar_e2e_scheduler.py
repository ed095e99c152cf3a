"""The grammar path inside the scheduler, stepped by hand on a tiny random Llama (fast):
matchers stay in step with outputs through jump-forward and retraction, streamed tokens are
never taken back, the grammar queue does not hold up other requests, and the compile options
(backend ``none``, timeout) are wired through."""

from __future__ import annotations

import json
import logging
import random
import re
import threading

import jsonschema
import pytest

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler import grammar_queue as grammar_queue_module

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{6,30}"
PROMPT_LEN = 40
RETRACT_POOL = 300  # 8 prompts of 40 tokens plus their outputs do not fit: decode retracts


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _params(i: int) -> dict:
    grammar = {"json_schema": json.dumps(SCHEMA)} if i % 2 == 0 else {"regex": REGEX}
    return {"temperature": 0, "max_new_tokens": 120, **grammar}


_GRAMMAR_DIR: list[str] = []  # one on-disk compile cache for the module's schedulers


def _scheduler(model_dir, **options) -> Scheduler:
    options.setdefault("grammar_cache_dir", _GRAMMAR_DIR[0] if _GRAMMAR_DIR else None)
    return Scheduler(config_from_kwargs(model_path=str(model_dir), log_level="warning", **options))


@pytest.fixture(scope="module", autouse=True)
def grammar_cache_dir(tmp_path_factory):
    _GRAMMAR_DIR.append(str(tmp_path_factory.mktemp("grammars")))
    yield
    _GRAMMAR_DIR.clear()


def _drive(
    sched: Scheduler,
    msgs: list[TokenizedGenerateReq],
    also: tuple[str, ...] = (),
    max_steps: int = 3000,
) -> dict:
    """Steps until idle, checking the grammar invariant after every step; returns per rid (of
    ``msgs`` and the already submitted ``also``) the token ids it reported and its finish."""
    for msg in msgs:
        sched.handle(msg)
    ids: dict[str, list[int]] = {rid: [] for rid in [m.rid for m in msgs] + list(also)}
    reasons: dict[str, dict] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            break
        out = sched.step()
        sched.grammars.check_integrity(sched.running + list(sched.waiting))
        for i, rid in enumerate(out.rids if out else []):
            ids[rid] += out.new_token_ids[i]
            if out.finish_reason[i] is not None:
                reasons[rid] = out.finish_reason[i]
    assert not sched.has_work(), "the scheduler did not finish"
    assert sched.check_idle()
    return {rid: (ids[rid], reasons.get(rid)) for rid in ids}


def _requests(n: int, stream_every: int = 2) -> list[TokenizedGenerateReq]:
    return [
        TokenizedGenerateReq(
            rid=f"r{i}", input_ids=p, sampling_params=_params(i), stream=i % stream_every == 0
        )
        for i, p in enumerate(_prompts(n))
    ]


def _check_valid(sched: Scheduler, results: dict) -> None:
    tok = sched.runner.tokenizer
    for i in range(len(results)):
        ids, reason = results[f"r{i}"]
        text = tok.decode(ids, skip_special_tokens=True)
        assert reason is not None and reason["type"] == "stop", (i, reason, text)
        if i % 2 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict:
    sched = _scheduler(tiny_llama_dir, max_total_tokens=8192)
    results = _drive(sched, _requests(8))
    assert sched.grammars.stats.num_forced_tokens > 0, "the workload was meant to jump forward"
    _check_valid(sched, results)
    return results


def test_streamed_and_jumped_outputs_are_valid(reference):
    assert len(reference) == 8


@pytest.mark.slow
def test_streamed_and_unstreamed_requests_get_the_same_tokens(tiny_llama_dir, reference):
    """Jump-forward re-encodes only the token sampled in its step with the forced text, which no
    stream has sent yet, so streaming changes no token (with four re-encoded tokens it did: a
    stream's sent tokens cannot be taken back, and greedy continuations then differed)."""
    results = {}
    for stream in (False, True):
        sched = _scheduler(tiny_llama_dir, max_total_tokens=8192)
        msgs = _requests(8)
        for m in msgs:
            m.stream = stream
        results[stream] = _drive(sched, msgs)
        sched.grammars.shutdown()
    assert results[False] == results[True]


def test_retraction_keeps_matchers_in_step_and_outputs_equal(tiny_llama_dir, reference, caplog):
    caplog.set_level(logging.INFO, logger="radixlm.srt.scheduler.scheduler")
    sched = _scheduler(tiny_llama_dir, max_total_tokens=RETRACT_POOL, schedule_conservativeness=0)
    results = _drive(sched, _requests(8))
    assert any("retract" in r.getMessage().lower() for r in caplog.records)
    _check_valid(sched, results)
    assert results == reference


@pytest.mark.slow
def test_prefetched_and_inline_masks_give_the_same_outputs(tiny_llama_dir, reference):
    rows = {}
    for prefetch in (False, True):
        sched = _scheduler(tiny_llama_dir, max_total_tokens=8192)
        sched.grammars.prefetch_enabled = prefetch
        assert _drive(sched, _requests(8)) == reference
        stats = sched.grammars.stats
        rows[prefetch] = (stats.num_prefetched_rows, stats.num_mask_rows)
        sched.grammars.shutdown()
    assert rows[False][0] == 0
    prefetched, total = rows[True]
    assert prefetched >= 0.9 * total, rows


@pytest.mark.slow
def test_jump_forward_saves_forward_steps(tiny_llama_dir):
    steps = {}
    for disable in (True, False):
        sched = _scheduler(tiny_llama_dir, max_total_tokens=8192, disable_jump_forward=disable)
        results = _drive(sched, [r for r in _requests(4) if r.rid in ("r0", "r2")])
        steps[disable] = sched.num_forward_steps
        for rid in ("r0", "r2"):
            ids, reason = results[rid]
            assert reason["type"] == "stop"
            jsonschema.validate(json.loads(sched.runner.tokenizer.decode(ids, True)), SCHEMA)
        assert (sched.grammars.stats.num_jump_forwards == 0) == disable
        if disable:  # every output token of the longer request took one step
            assert steps[disable] == max(len(ids) for ids, _ in results.values())
    assert steps[False] < steps[True] - 4, steps


def test_plain_requests_flow_while_a_grammar_compiles(tiny_llama_dir, monkeypatch):
    release = threading.Event()
    real_create = grammar_queue_module.create_compile_cache

    def gated_cache(config, vocab):
        cache = real_create(config, vocab)
        compile_now = cache.backend.compile_controlled  # what the cache's workers call

        def compile_when_released(spec, control):
            assert release.wait(60)
            return compile_now(spec, control)

        cache.backend.compile_controlled = compile_when_released
        return cache

    monkeypatch.setattr(grammar_queue_module, "create_compile_cache", gated_cache)
    sched = _scheduler(tiny_llama_dir, max_total_tokens=4096, grammar_cache_dir=None)
    prompts = _prompts(2)
    sched.handle(TokenizedGenerateReq("constrained", prompts[0], _params(1)))
    sched.handle(TokenizedGenerateReq("plain", prompts[1], {"temperature": 0, "max_new_tokens": 8}))
    finished = set()
    while "plain" not in finished:
        out = sched.step()
        finished |= {rid for i, rid in enumerate(out.rids if out else []) if out.finish_reason[i]}
    assert "constrained" not in finished and sched.grammars.queue.has_pending()
    release.set()
    ((ids, reason),) = _drive(sched, [], also=("constrained",)).values()
    assert reason["type"] == "stop"
    assert re.fullmatch(REGEX, sched.runner.tokenizer.decode(ids, skip_special_tokens=True))
    assert sched.grammars.stats.num_compiled == 1


def test_backend_none_rejects_grammars(tiny_llama_dir):
    sched = _scheduler(tiny_llama_dir, max_total_tokens=4096, grammar_backend="none")
    msg = TokenizedGenerateReq("r", _prompts(1)[0], _params(1))
    ((_, reason),) = _drive(sched, [msg]).values()
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert reason["message"].startswith(
        "Failed to compile regex grammar: constrained decoding is disabled"
    )


def test_compile_timeout_fails_the_request(tiny_llama_dir, monkeypatch):
    real_create = grammar_queue_module.create_compile_cache

    def slow_cache(config, vocab):
        cache = real_create(config, vocab)
        compile_now = cache.backend.compile_controlled
        cache.backend.compile_controlled = lambda spec, control: (
            threading.Event().wait(2.0) or compile_now(spec, control)
        )
        return cache

    monkeypatch.setattr(grammar_queue_module, "create_compile_cache", slow_cache)
    sched = _scheduler(
        tiny_llama_dir, max_total_tokens=4096, grammar_compile_timeout_s=0.2, grammar_cache_dir=None
    )
    msg = TokenizedGenerateReq("r", _prompts(1)[0], _params(1))
    ((_, reason),) = _drive(sched, [msg]).values()
    assert reason["status_code"] == 400
    assert reason["message"] == (
        "Failed to compile regex grammar: compilation did not finish within 0.2 s"
    )
