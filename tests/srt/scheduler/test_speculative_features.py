"""Speculative decoding with the scheduler's other features: grammars (masks per draft
position, drafts cut where the grammar rejects them, jump-forward), stop tokens and strings
inside an accepted run, output logprobs of every accepted token, streaming several tokens per
step, retraction under a small pool, aborts, seeded sampling, overlap scheduling, requests left
out of speculation, and the figures in server info and /metrics. Scheduler stepped by hand on
tiny random Llamas; after each run nothing is left (KV, rows, plans, drafter state)."""

from __future__ import annotations

import json

import pytest
import regex
from spec_harness import (
    FixedDrafter,
    OracleDrafter,
    ProbDrafter,
    check_idle,
    drive,
    make_scheduler,
    msg,
    prompts,
    repetitive_prompts,
)

from radixlm.srt.messages import AbortReq
from radixlm.srt.speculative import Draft

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "tag", "n"],
    "additionalProperties": False,
}
LETTERS = r"[a-z]{20,40}"


@pytest.fixture(scope="module")
def varied_llama_dir(tiny_model_writer, tmp_path_factory, default_model_dir):
    """A tiny random Llama whose greedy tokens depend on the context (see test_speculative)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return tiny_model_writer(tmp_path_factory.mktemp("varied-llama"), tok, initializer_range=0.2)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _plain(model_dir, msgs, **options):
    s = make_scheduler(model_dir, algorithm="none", **options)
    got = drive(s, msgs)
    check_idle(s)
    s.grammars.shutdown()
    return got


def _speculate(model_dir, msgs, drafter=None, arrivals=None, hook=None, **options):
    s = make_scheduler(model_dir, drafter, **options)
    got = drive(s, msgs, arrivals, hook)
    check_idle(s)
    s.grammars.shutdown()
    return s, got


def _oracle(reference_msgs, got, spoil=True) -> OracleDrafter:
    return OracleDrafter({tuple(m.input_ids): got[m.rid].ids for m in reference_msgs}, spoil=spoil)


def _grammar_msgs(max_new_tokens=120):
    ms = [
        msg(f"j{i}", p, max_new_tokens=max_new_tokens, json_schema=json.dumps(SCHEMA))
        for i, p in enumerate(prompts(1, 3))
    ]
    ms += [msg(f"x{i}", p, max_new_tokens=60, regex=LETTERS) for i, p in enumerate(prompts(2, 2))]
    for m in ms:
        m.sampling_params["ignore_eos"] = False
    return ms


def _check_valid(tokenizer, got):
    for rid, r in got.items():
        assert r.reason["type"] == "stop", (rid, r.reason)
        text = tokenizer.decode(r.ids, skip_special_tokens=True)
        if rid.startswith("j"):
            value = json.loads(text)
            assert set(value) == {"ok", "tag", "n"} and value["tag"] in ("red", "green")
            assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
        else:
            assert regex.fullmatch(LETTERS, text), text


def test_grammar_outputs_stay_valid_with_ngram_and_jump_forward(tiny_llama_dir, tokenizer):
    s, got = _speculate(tiny_llama_dir, _grammar_msgs())
    _check_valid(tokenizer, got)
    assert s.server_info()["speculative"]["num_verify_steps"] > 0
    assert s.grammars.stats.num_jump_forwards > 0


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["oracle", "wrong"])
def test_grammar_greedy_outputs_are_unchanged(tiny_llama_dir, tokenizer, drafter_kind):
    """Without jump-forward (whose edits depend on where steps end), constrained greedy
    outputs are token-identical; wrong drafts are cut by the grammar before the forward."""
    ms = _grammar_msgs()
    want = _plain(tiny_llama_dir, ms, disable_jump_forward=True)
    _check_valid(tokenizer, want)
    drafter = _oracle(ms, want) if drafter_kind == "oracle" else FixedDrafter([90, 91, 92])
    s, got = _speculate(tiny_llama_dir, _grammar_msgs(), drafter, disable_jump_forward=True)
    assert {k: v.ids for k, v in got.items()} == {k: v.ids for k, v in want.items()}
    info = s.server_info()["speculative"]
    if drafter_kind == "oracle":
        assert info["num_accepted_tokens"] > 20, info
    else:  # drafts are cut where the grammar rejects them, often to nothing
        assert info["num_proposed_tokens"] < drafter.num_proposed / 2, info
        assert info["num_verify_steps"] > 10, info


def test_stops_inside_accepted_runs(varied_llama_dir, tokenizer):
    """A stop token id and a stop string met in the middle of a fully accepted draft: the run
    is cut exactly where plain decoding stops."""
    base = [msg(f"s{i}", p, max_new_tokens=40) for i, p in enumerate(prompts(4, 2))]
    ref = _plain(varied_llama_dir, base)
    stop_id = ref["s0"].ids[13]
    word = next(
        w for t in ref["s1"].ids[9:] if len(w := tokenizer.decode([t]).strip()) >= 3 and w.isalpha()
    )
    ms = [
        msg("s0", base[0].input_ids, max_new_tokens=40, stop_token_ids=[stop_id], ignore_eos=False),
        msg("s1", base[1].input_ids, max_new_tokens=40, stop=[word]),
    ]
    want = _plain(varied_llama_dir, ms)
    assert want["s0"].reason == {"type": "stop", "matched": stop_id}
    assert want["s1"].reason == {"type": "stop", "matched": word}
    drafter = _oracle(base, ref, spoil=False)
    s, got = _speculate(varied_llama_dir, ms, drafter, speculative_num_draft_tokens=6)
    for rid in ("s0", "s1"):
        assert (got[rid].ids, got[rid].reason) == (want[rid].ids, want[rid].reason)
    assert s.server_info()["speculative"]["acceptance_rate"] == 1.0


@pytest.mark.parametrize("top", [0, 3])
def test_logprobs_of_every_accepted_token(varied_llama_dir, top):
    """Output logprobs, and the token_ids_logprob rows, of accepted runs are plain decoding's."""
    ids = [7, 300, 2000] if top else None
    ms = [
        msg(f"l{i}", p, max_new_tokens=20, logprobs=top, token_ids=ids)
        for i, p in enumerate(prompts(6, 2))
    ]
    want = _plain(varied_llama_dir, ms)
    s, got = _speculate(varied_llama_dir, ms, _oracle(ms, want))
    assert s.server_info()["speculative"]["num_accepted_tokens"] > 5
    for rid, r in got.items():
        assert r.ids == want[rid].ids and len(r.logprobs) == len(r.ids) == 20
        for (lp, tok), (want_lp, want_tok) in zip(r.logprobs, want[rid].logprobs, strict=True):
            assert tok == want_tok and lp == pytest.approx(want_lp, abs=1e-4)
        assert len(r.id_rows) == (20 if ids else 0)
        for row, want_row in zip(r.id_rows, want[rid].id_rows, strict=True):
            assert [t for _, t in row] == ids == [t for _, t in want_row]
            assert [v for v, _ in row] == pytest.approx([v for v, _ in want_row], abs=1e-4)


def test_streaming_sends_several_tokens_per_step(varied_llama_dir):
    m = msg("st", prompts(7, 1)[0], stream=True, max_new_tokens=30)
    want = _plain(varied_llama_dir, [m])
    s, got = _speculate(varied_llama_dir, [m], _oracle([m], want, spoil=False))
    assert got["st"].ids == want["st"].ids
    assert got["st"].num_entries <= 1 + 30 // 5 + 1  # the prefill's token, then runs of 5
    assert want["st"].num_entries == 30


def test_retraction_under_a_small_pool(varied_llama_dir):
    """Six requests of 21 + 40 tokens in a 200-token pool: decode retracts; drafts are only
    proposed when they fit (never a reason to retract); retracted requests are released by the
    drafter and come back with the same greedy output."""
    ms = [msg(f"p{i}", p, max_new_tokens=40) for i, p in enumerate(prompts(8, 6, length=21))]
    want = _plain(varied_llama_dir, ms)
    retracted = []

    def hook(s, step):
        retracted.append(sum(1 for r in s.waiting if r.output_ids))

    drafter = _oracle(ms, want)
    s, got = _speculate(varied_llama_dir, ms, drafter, max_total_tokens=200, hook=hook)
    assert max(retracted) > 0
    assert {k: v.ids for k, v in got.items()} == {k: v.ids for k, v in want.items()}
    assert len(drafter.released) > len(ms)  # once per retraction, and once at the finish
    assert s.server_info()["speculative"]["num_accepted_tokens"] > 0


def test_abort_while_speculating(tiny_llama_dir):
    ms = [msg(f"a{i}", p, max_new_tokens=200) for i, p in enumerate(repetitive_prompts(9, 3))]

    def hook(s, step):
        if step == 6:
            s.handle(AbortReq(rid="a1"))
        if step == 9:
            s.handle(AbortReq(abort_all=True))

    s, got = _speculate(tiny_llama_dir, ms, hook=hook)
    assert got["a1"].reason["type"] == "abort" and got["a0"].reason["type"] == "abort"
    assert s.server_info()["speculative"]["num_accepted_tokens"] > 0


QUALIFYING_SEED = {"one-hot": 50, "prob": 32}


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["one-hot", "prob"])
def test_seeded_sampled_requests_are_reproducible(varied_llama_dir, tokenizer, drafter_kind):
    """Temperatures where drafts of the greedy continuation are mostly accepted (0.03) and
    almost never (1.0): every run with the same seeds gives the same tokens, other seeds other
    tokens."""
    ps = prompts(10, 2)
    greedy = [msg(f"q{i}", p, max_new_tokens=20) for i, p in enumerate(ps)]
    ref = _plain(varied_llama_dir, greedy)
    by_prompt = {tuple(m.input_ids): ref[m.rid].ids for m in greedy}

    def run(seed):
        ms = [
            msg(f"q{i}", p, temperature=t, seed=seed + i, max_new_tokens=20)
            for i, (p, t) in enumerate(zip(ps, (0.03, 1.0), strict=True))
        ]
        if drafter_kind == "prob":
            drafter = ProbDrafter(by_prompt, len(tokenizer))  # the model's vocabulary
        else:
            drafter = OracleDrafter(by_prompt, spoil=False)
        s, got = _speculate(varied_llama_dir, ms, drafter)
        return {k: v.ids for k, v in got.items()}, s.server_info()["speculative"]

    # a seed under which request q0 (T = 0.03) follows its greedy path for a while: whether
    # it does depends on its first draws (this model has near-ties); the search is the same
    # every run, and about one seed in five qualifies for either drafter. It starts at the
    # seed it found on the 2-core machine (each try is a scheduler run: the whole search took
    # 16 and 10 of them), then tries the rest in order
    for seed in [QUALIFYING_SEED[drafter_kind], *range(5, 65, 3)]:
        first, info = run(seed)
        if info["num_accepted_tokens"] > 5:
            break
    again, _ = run(seed)
    other, _ = run(seed + 1000)
    assert first == again and first != other
    assert first["q1"] != ref["q1"].ids  # really sampled
    assert info["num_accepted_tokens"] > 5 and info["acceptance_rate"] < 0.9, info


def test_requests_reading_their_outputs_decode_plainly(varied_llama_dir):
    """Penalties, logit bias and min_new_tokens read the outputs: never drafted; the others
    in the same batch still are."""
    p = prompts(11, 4)
    ms = [
        msg("pen", p[0], frequency_penalty=0.5),
        msg("bias", p[1], logit_bias={"100": 1.0}),
        msg("min", p[2], min_new_tokens=5),
        msg("free", p[3]),
    ]
    want = _plain(varied_llama_dir, ms)
    drafter = FixedDrafter([7, 8, 9])
    _, got = _speculate(varied_llama_dir, ms, drafter)
    assert {k: v.ids for k, v in got.items()} == {k: v.ids for k, v in want.items()}
    assert drafter.released == ["free"]


class PausingDrafter(OracleDrafter):
    """Proposes for a request every other time it is asked (as an adaptive drafter pausing)."""

    def __init__(self, reference) -> None:
        super().__init__(reference, spoil=False)
        self.calls: dict[str, int] = {}

    def draft_for(self, req, max_tokens):
        self.calls[req.rid] = self.calls.get(req.rid, 0) + 1
        if self.calls[req.rid] % 2:
            return Draft([])
        return super().draft_for(req, max_tokens)


def test_overlap_scheduling_with_speculation(varied_llama_dir):
    """Overlap on (its bookkeeping runs on a CPU too): a decode batch in which nothing was
    drafted is launched overlapped, and read back before the next one is planned (a request
    that may speculate needs its last token on the host); outputs are those of plain
    synchronous decoding."""
    p = prompts(12, 3)
    ms = [msg(f"o{i}", p[i], max_new_tokens=20) for i in range(3)]
    want = _plain(varied_llama_dir, ms)
    in_flight = []

    def hook(s, step):
        s.overlap = True
        in_flight.append(s.inflight is not None)

    drafter = PausingDrafter({tuple(m.input_ids): want[m.rid].ids for m in ms})
    s, got = _speculate(varied_llama_dir, ms, drafter, hook=hook)
    assert {k: v.ids for k, v in got.items()} == {k: v.ids for k, v in want.items()}
    assert sum(in_flight) >= 3 and not all(in_flight[1:])
    assert s.server_info()["speculative"]["num_accepted_tokens"] > 10


def test_server_info_and_metrics(tiny_llama_dir):
    from radixlm.srt.server.http.metrics import ServerMetrics

    ms = [msg(f"m{i}", p, max_new_tokens=30) for i, p in enumerate(repetitive_prompts(13, 2))]
    s, _ = _speculate(tiny_llama_dir, ms)
    info = s.server_info()["speculative"]
    assert info["algorithm"] == "ngram" and info["num_draft_tokens"] == 4
    assert 0 < info["acceptance_rate"] <= 1 and info["mean_accept_length"] > 1
    assert info["drafter"]["num_proposed"] >= info["num_proposed_tokens"]
    metrics = ServerMetrics("tiny")
    metrics.update_scheduler(s.server_info())
    text = metrics.render().decode()
    line = next(x for x in text.splitlines() if x.startswith("radixlm_speculative_accept"))
    assert float(line.split()[-1]) == pytest.approx(info["acceptance_rate"])
    assert "radixlm_speculative_num_verify_steps" in text
