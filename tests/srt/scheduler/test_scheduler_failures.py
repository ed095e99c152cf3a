"""One bad request ends alone: a grammar the matcher gives up on mid-decoding, a token id the
model cannot embed, a sampling row that raises, a step that fails for no request in particular
(every held request is answered and released). Also: exact-rid aborts, and a grammar that
forces text forever ends with ``length``. Scheduler stepped by hand on a tiny random Llama
(SmolLM2's tokenizer); after each test no KV, request row or request state is left."""

from __future__ import annotations

import json
import random
import threading

import pytest

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import AbortReq, FlushCacheReq, TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.failures import run_step

POOL = 4096
# Eight free letters (what the compile-time probe sees), then braces around 5,000 optional
# words: llguidance's row after ``{`` has about 10,000 Earley items (its limit is 8,000), so the
# matcher fails while decoding ("Current row has 10001 items").
HOSTILE_EBNF = (
    'root ::= [a-z] [a-z] [a-z] [a-z] [a-z] [a-z] [a-z] [a-z] "{" '
    + " ".join(f'"k{i}"?' for i in range(5000))
    + ' "}"'
)
# Eight free letters, then "a" forever: compiles (the probe sees letters only), then forces an
# endless continuation, which llguidance computes to its item limit and errors on.
ENDLESS_EBNF = 'root ::= [a-z] [a-z] [a-z] [a-z] [a-z] [a-z] [a-z] [a-z] tail\ntail ::= "a" tail'


@pytest.fixture(scope="module")
def sched(tiny_llama_dir, tmp_path_factory):
    """One scheduler for the module (the grammar vocabulary is built once); every test must
    leave it idle and leak-free."""
    cfg = config_from_kwargs(
        model_path=str(tiny_llama_dir),
        log_level="warning",
        max_total_tokens=POOL,
        grammar_backend="llguidance",
        grammar_cache_dir=str(tmp_path_factory.mktemp("grammars")),
    )
    s = Scheduler(cfg)
    yield s
    s.grammars.shutdown()


@pytest.fixture(autouse=True)
def idle_and_leak_free(request):
    yield
    if "sched" in request.fixturenames:
        check_idle(request.getfixturevalue("sched"))


def check_idle(s: Scheduler) -> None:
    assert not s.has_work()
    u = s.kv.usage()
    assert u["available"] + u["evictable"] + u["protected"] == POOL, u
    assert u["protected"] == 0, u
    assert s.check_idle()  # also: every request row free, no request state left
    assert not s.live and not s.running and not s.waiting and s.chunked is None


def _prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _msg(rid: str, seed: int, stream: bool = False, **params) -> TokenizedGenerateReq:
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, **params}
    return TokenizedGenerateReq(
        rid=rid, input_ids=_prompt(seed), sampling_params=params, stream=stream
    )


FINISHED_AT: dict[str, int] = {}  # rid -> the step of the last ``drive`` that finished it


def drive(s: Scheduler, msgs=(), hook=None, max_steps: int = 20000) -> dict[str, tuple]:
    """Steps (through ``run_step``, as the server does) until idle; per rid its token ids and
    finish reason. ``hook(s, step)`` runs before each step."""
    FINISHED_AT.clear()
    for m in msgs:
        s.handle(m)
    ids: dict[str, list[int]] = {}
    reasons: dict[str, dict] = {}
    for step in range(max_steps):
        if not s.has_work():
            break
        if hook is not None:
            hook(s, step)
        out = run_step(s)
        for i, rid in enumerate(out.rids if out else []):
            assert rid not in reasons, f"{rid} reported after its finish"
            ids.setdefault(rid, []).extend(out.new_token_ids[i])
            if out.finish_reason[i] is not None:
                reasons[rid] = out.finish_reason[i]
                FINISHED_AT[rid] = step
    assert not s.has_work(), "the scheduler did not finish"
    return {rid: (ids.get(rid, []), reasons.get(rid)) for rid in set(ids) | set(reasons)}


def serial(s: Scheduler, msgs) -> dict[str, tuple]:
    out = {}
    for m in msgs:
        out.update(drive(s, [m]))
    return out


PLAIN = [
    ("p0", 0, {"max_new_tokens": 60}),
    ("p1", 1, {"max_new_tokens": 40}),
    ("g0", 2, {"regex": r"[a-z]{30,40}"}),
]


def _plain_msgs(stream: bool = False):
    return [_msg(rid, seed, stream=stream, **p) for rid, seed, p in PLAIN]


@pytest.mark.slow
def test_hostile_grammar_mid_batch_ends_only_its_request(sched):
    expected = serial(sched, _plain_msgs())
    bad = _msg("bad", 9, max_new_tokens=120, ebnf=HOSTILE_EBNF)
    serial(sched, [bad])  # compiles the grammar; the batch below finds it compiled
    got = drive(sched, [bad, *_plain_msgs(stream=True)])
    ids, reason = got["bad"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert "failed while decoding" in reason["message"] and "items" in reason["message"]
    assert FINISHED_AT["bad"] < min(FINISHED_AT[rid] for rid, _, _ in PLAIN), FINISHED_AT
    for rid, _, _ in PLAIN:
        assert got[rid] == expected[rid], rid


def test_endless_forced_grammar_ends_with_length(sched):
    got = drive(sched, [_msg("endless", 3, max_new_tokens=40, ebnf=ENDLESS_EBNF)])
    ids, reason = got["endless"]
    assert reason == {"type": "length", "length": 40}, reason
    assert len(ids) == 40
    text = sched.runner.tokenizer.decode(ids)
    assert len(text) >= 8 and set(text[8:]) == {"a"}, text
    assert sched.grammars.stats.num_forced_tokens > 0, "the tail was meant to be jumped"


def test_abort_matches_the_rid_exactly(sched):
    rids = ["2", "20", "2a", "12"]
    msgs = [_msg(r, i, max_new_tokens=30) for i, r in enumerate(rids)]
    got = drive(sched, msgs, hook=lambda s, step: step == 3 and s.handle(AbortReq(rid="2")))
    assert got["2"][1]["type"] == "abort"
    for r in rids[1:]:
        assert got[r][1] == {"type": "length", "length": 30}, r


def test_abort_all_still_ends_everything(sched):
    msgs = [_msg(f"a{i}", i, max_new_tokens=200) for i in range(3)]
    got = drive(sched, msgs, hook=lambda s, step: step == 3 and s.abort("", abort_all=True))
    assert all(got[f"a{i}"][1]["type"] == "abort" for i in range(3))


def _corrupt_at(step_no: int, rid: str, corrupt):
    """A hook that changes one running request's state after admission, as a bug elsewhere or
    a value past validation would."""

    def hook(s: Scheduler, step: int) -> None:
        if step == step_no:
            (req,) = [r for r in s.running if r.rid == rid]
            corrupt(s, req)

    return hook


def test_a_token_the_model_cannot_embed_ends_only_its_request(sched):
    expected = serial(sched, _plain_msgs())
    victim = _msg("victim", 7, max_new_tokens=30)
    vocab = sched.runner.vocab_size

    def corrupt(s, req):
        req.output_ids[-1] = vocab + 5  # the next decode step's input

    got = drive(sched, [victim, *_plain_msgs()], hook=_corrupt_at(3, "victim", corrupt))
    reason = got["victim"][1]
    assert reason["type"] == "abort" and reason["status_code"] == 500, reason
    assert f"outside [0, {vocab})" in reason["message"]
    for rid, _, _ in PLAIN:
        assert got[rid] == expected[rid], rid


def test_a_sampling_row_that_raises_ends_only_its_request(sched):
    expected = serial(sched, _plain_msgs())
    victim = _msg("victim", 7, max_new_tokens=30)

    def corrupt(s, req):
        object.__setattr__(req.params, "temperature", "hot")  # validation would refuse it

    got = drive(sched, [victim, *_plain_msgs()], hook=_corrupt_at(3, "victim", corrupt))
    reason = got["victim"][1]
    assert reason["type"] == "abort" and reason["status_code"] == 500, reason
    assert "sampling" in reason["message"]
    for rid, _, _ in PLAIN:
        assert got[rid] == expected[rid], rid


class _BrokenPolicy:
    """A policy with a bug: the step fails in admission, for no request in particular."""

    def order(self, waiting, cache, running=()):
        raise RuntimeError("policy bug")


def test_a_failed_step_answers_and_releases_every_held_request(sched):
    late = _msg("late", 11, max_new_tokens=8)
    policy = sched.policy

    def hook(s: Scheduler, step: int) -> None:
        if step == 4:  # the first three decode; "late" arrives and admission breaks
            s.handle(late)
            s.policy = _BrokenPolicy()
        elif step == 6:
            s.policy = policy

    try:
        got = drive(sched, [_msg(f"r{i}", i, max_new_tokens=50) for i in range(3)], hook=hook)
    finally:
        sched.policy = policy
    for i in range(3):
        reason = got[f"r{i}"][1]
        assert reason["type"] == "abort" and reason["status_code"] == 500, reason
        assert "policy bug" in reason["message"]
    assert got["late"][1] == {"type": "length", "length": 8}  # held no KV: it runs later


@pytest.mark.slow
def test_idle_after_grammar_finish_stream_and_abort(tiny_llama_dir, tmp_path):
    """Grammar requests (jump-forward, EOS and length finishes), streamed or not, one aborted
    mid-stream, for page sizes 1 and 4 and with chunked prefill: idle means leak-free."""
    specs = [
        {"regex": r"[a-z]{3,8}"},
        {"regex": r"(cat|dog) and (cat|dog)"},
        {
            "json_schema": json.dumps(
                {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            )
        },
        {"ebnf": 'root ::= "x" ("ab" | "cd")+ "yz"'},
        {},
    ]
    for opts in ({}, {"page_size": 4}, {"chunked_prefill_size": 8}):
        s = Scheduler(
            config_from_kwargs(
                model_path=str(tiny_llama_dir),
                log_level="warning",
                max_total_tokens=POOL,
                grammar_cache_dir=str(tmp_path),
                **opts,
            )
        )
        try:
            msgs = [
                _msg(
                    f"s{i}",
                    i % 4,
                    stream=i % 2 == 0,
                    max_new_tokens=6 + 7 * (i % 3),
                    ignore_eos=False,
                    **specs[i % len(specs)],
                )
                for i in range(10)
            ]
            got = drive(s, msgs, hook=lambda s, step: step == 5 and s.abort("s4"))
            assert len(got) == 10
            assert {r[1]["type"] for r in got.values()} >= {"stop", "length"}, got
            check_idle(s)
            assert s.handle(FlushCacheReq(req_id="f")).ok
        finally:
            s.grammars.shutdown()


def test_engine_abort_of_a_batch_rid_ends_every_sample(tiny_llama_dir):
    from radixlm.srt import Engine

    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning")
    try:
        params = {"temperature": 0.7, "max_new_tokens": 1500, "ignore_eos": True, "n": 3}
        box: dict = {}
        caller = threading.Thread(
            target=lambda: box.update(
                out=engine.generate(input_ids=_prompt(0), sampling_params=params, rid="grp")
            )
        )
        caller.start()
        while "grp" not in engine.front.client_rids and caller.is_alive():
            caller.join(0.01)
        engine.abort("grp")
        caller.join(120)
        assert not caller.is_alive()
        reasons = [o["meta_info"]["finish_reason"]["type"] for o in box["out"]]
        assert reasons == ["abort"] * 3
        assert engine.scheduler.check_idle()
    finally:
        engine.shutdown()
