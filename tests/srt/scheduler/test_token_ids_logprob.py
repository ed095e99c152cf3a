"""SGLang's ``token_ids_logprob`` in the scheduler (stepped by hand on a tiny random Llama):
every output and input position gets the logprobs of exactly the requested ids, in their
order, equal to the full log_softmax's entries (the top-logprob rows and the chosen tokens'
logprobs of the same run, and a log_softmax of the model's logits computed here); input rows
follow ``logprob_start_len`` and chunked prefill; a prefill-only request gets one output row,
the next token's distribution."""

from __future__ import annotations

import pytest
import torch
from spec_harness import check_idle, drive, make_scheduler, msg, prompts

TOP = 20


def _run(model_dir, msgs, **options):
    s = make_scheduler(model_dir, algorithm="none", **options)
    got = drive(s, msgs)
    check_idle(s)
    s.grammars.shutdown()
    return s, got


def _as_dict(row) -> dict[int, float]:
    return {t: v for v, t in row}


def _check_against_top(id_rows, top_rows, ids) -> int:
    """Each id row holds ``ids`` in order; where an id is among the top entries of the same
    position, the values agree. Returns how many values were compared."""
    assert len(id_rows) == len(top_rows)
    compared = 0
    for row, top in zip(id_rows, top_rows, strict=True):
        assert [t for _, t in row] == ids
        values, tops = _as_dict(row), _as_dict(top)
        for t in set(values) & set(tops):
            assert values[t] == pytest.approx(tops[t], abs=1e-4)
            compared += 1
    return compared


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """A greedy run with the top 20 logprobs at every input (from 3) and output position."""
    m = msg("ref", prompts(11, 1, length=30)[0], logprobs=TOP, start=3, max_new_tokens=12)
    return m, _run(tiny_llama_dir, [m])[1]["ref"]


def _ids_of(ref) -> list[int]:
    """Ids that occur in the reference's top rows, the chosen tokens among them, and two
    that do not (most likely), in a fixed shuffled order."""
    seen = {t for row in ref.top + ref.input_top for _, t in row}
    ids = sorted(seen)[::3] + [t for _, t in ref.logprobs] + [1, 49151]
    return list(dict.fromkeys(ids))[::-1]


def test_rows_equal_the_full_log_softmax(tiny_llama_dir, reference):
    m, ref = reference
    ids = _ids_of(ref)
    asked = msg("ids", m.input_ids, logprobs=0, start=3, max_new_tokens=12, token_ids=ids)
    got = _run(tiny_llama_dir, [asked])[1]["ids"]
    assert got.ids == ref.ids and got.top == [] and len(got.id_rows) == 12
    assert _check_against_top(got.id_rows, ref.top, ids) > 12
    for row, (lp, tok) in zip(got.id_rows, got.logprobs, strict=True):  # the chosen token
        assert _as_dict(row)[tok] == pytest.approx(lp, abs=1e-5)
    # input rows: one per input logprob position (from logprob_start_len), the prompt's next
    # token among them with its input logprob
    assert len(got.input_id_rows) == len(ref.input_lps) == len(m.input_ids) - 3
    assert _check_against_top(got.input_id_rows, ref.input_top, ids) > 0
    prompt = m.input_ids
    for pos, (row, (lp, tok)) in enumerate(zip(got.input_id_rows, got.input_lps, strict=True)):
        assert tok == prompt[3 + pos]
        if tok in ids:
            assert _as_dict(row)[tok] == pytest.approx(lp, abs=1e-5)


def test_first_position_and_model_logits(tiny_llama_dir):
    """From position 0 the first row is empty (no logprob before the first token), as its
    input logprob is None; the last prompt position's row is the model's own log_softmax."""
    s = make_scheduler(tiny_llama_dir, algorithm="none")
    prompt = prompts(12, 1, length=9)[0]
    ids = [0, 5, 42, 17000]
    got = drive(s, [msg("z", prompt, logprobs=0, start=0, max_new_tokens=1, token_ids=ids)])["z"]
    assert got.input_lps[0][0] is None and got.input_id_rows[0] == []
    assert len(got.input_id_rows) == len(prompt)
    batch_ids = torch.tensor([prompt])
    with torch.no_grad():
        model = _hf_model(tiny_llama_dir)
        logits = model(batch_ids).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)[:, ids]
    for pos in range(1, len(prompt)):
        assert [v for v, _ in got.input_id_rows[pos]] == pytest.approx(
            want[pos - 1].tolist(), abs=2e-3
        )
    assert [v for v, _ in got.id_rows[0]] == pytest.approx(want[-1].tolist(), abs=2e-3)
    check_idle(s)
    s.grammars.shutdown()


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_prefill_only_gets_the_next_token_row(tiny_llama_dir):
    prompt = prompts(13, 1, length=17)[0]
    ids = [3, 99, 4000]
    one = msg("one", prompt, logprobs=2, max_new_tokens=1, token_ids=ids)
    zero = msg("zero", prompt, logprobs=2, max_new_tokens=0, token_ids=ids)
    got = _run(tiny_llama_dir, [one])[1]
    got.update(_run(tiny_llama_dir, [zero])[1])
    assert got["zero"].ids == [] and got["zero"].logprobs == []
    assert got["zero"].reason == {"type": "length", "length": 0}
    assert len(got["zero"].id_rows) == len(got["zero"].top) == 1
    for key in ("id_rows", "top"):
        (row,) = getattr(got["zero"], key)
        want = getattr(got["one"], key)[0]
        assert [t for _, t in row] == [t for _, t in want]
        assert [v for v, _ in row] == pytest.approx([v for v, _ in want], abs=1e-4)


def test_chunked_prefill_keeps_the_input_rows(tiny_llama_dir):
    """A prompt prefilled in chunks of 16 gets the input rows of one unchunked prefill."""
    prompt = prompts(14, 1, length=70)[0]
    ids = [11, 700, 30000]

    def rows(**options):
        m = msg("c", prompt, logprobs=0, start=5, max_new_tokens=3, token_ids=ids)
        return _run(tiny_llama_dir, [m], **options)[1]["c"]

    whole, chunked = rows(chunked_prefill_size=-1), rows(chunked_prefill_size=16)
    assert len(chunked.input_id_rows) == len(whole.input_id_rows) == len(prompt) - 5
    pairs = zip(
        chunked.input_id_rows + chunked.id_rows, whole.input_id_rows + whole.id_rows, strict=True
    )
    for a, b in pairs:
        assert [t for _, t in a] == ids == [t for _, t in b]
        assert [v for v, _ in a] == pytest.approx([v for v, _ in b], abs=1e-4)


def test_requests_without_ids_carry_none(tiny_llama_dir):
    """In an output where one request has token-ids rows, the others' entries are None; an
    output where none has them keeps the lists empty."""
    s = make_scheduler(tiny_llama_dir, algorithm="none")
    ps = prompts(15, 2)
    s.handle(msg("a", ps[0], stream=True, logprobs=0, max_new_tokens=2, token_ids=[1, 2]))
    s.handle(msg("b", ps[1], stream=True, logprobs=0, max_new_tokens=2))
    out = s.step()
    assert sorted(out.rids) == ["a", "b"]
    by_rid = dict(zip(out.rids, out.output_token_ids_logprobs, strict=True))
    assert by_rid["b"] is None and len(by_rid["a"]) == 1
    drive(s)
    s.handle(msg("c", ps[1], logprobs=0, max_new_tokens=2))
    while s.has_work():
        out = s.step()
        if out is not None:
            assert out.output_token_ids_logprobs == [] == out.input_token_ids_logprobs
    check_idle(s)
    s.grammars.shutdown()
