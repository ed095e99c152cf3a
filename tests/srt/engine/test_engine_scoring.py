"""``token_ids_logprob`` and ``Engine.score`` / ``async_score`` on the default model (the real
scheduler): the requested ids' logprobs are the full log_softmax's (the top-logprob entries of
the same positions), and scores are the probabilities the model's own input logprobs give."""

from __future__ import annotations

import asyncio
import math

import pytest

pytestmark = pytest.mark.slow  # the default model (smol_engine)

PROMPT = "The capital of France is"


def _as_dict(row) -> dict[int, float]:
    return {t: v for v, t, _ in row}


def test_token_ids_logprob_equals_the_top_logprobs(smol_engine) -> None:
    sp = {"max_new_tokens": 3, "temperature": 0}
    ref = smol_engine.generate(
        PROMPT, sp, return_logprob=True, logprob_start_len=2, top_logprobs_num=20
    )["meta_info"]
    rows = ref["output_top_logprobs"] + ref["input_top_logprobs"]
    ids = sorted({t for row in rows for _, t, _ in row})[::2] + [0, 49151]
    out = smol_engine.generate(
        PROMPT,
        sp,
        return_logprob=True,
        logprob_start_len=2,
        token_ids_logprob=ids,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    assert meta["output_top_logprobs"] == []  # no top_logprobs_num this time
    pairs = [
        (meta["output_token_ids_logprobs"], ref["output_top_logprobs"]),
        (meta["input_token_ids_logprobs"], ref["input_top_logprobs"]),
    ]
    compared = 0
    for got_rows, top_rows in pairs:
        assert len(got_rows) == len(top_rows)
        for got, top in zip(got_rows, top_rows, strict=True):
            assert [t for _, t, _ in got] == ids
            assert all(text == smol_engine.tokenizer.decode([t]) for _, t, text in got)
            values, tops = _as_dict(got), _as_dict(top)
            for t in set(values) & set(tops):
                assert values[t] == pytest.approx(tops[t], abs=1e-4)
                compared += 1
    assert compared > len(ids)
    for row, (lp, tok, _) in zip(
        meta["output_token_ids_logprobs"], meta["output_token_logprobs"], strict=True
    ):
        if tok in ids:
            assert _as_dict(row)[tok] == pytest.approx(lp, abs=1e-5)
    with pytest.raises(ValueError, match="token_ids_logprob"):
        smol_engine.generate(PROMPT, sp, return_logprob=True, token_ids_logprob=[10**7])


def _label_logprob(engine, prompt_ids: list[int], label: int) -> float:
    """The model's logprob of ``label`` after ``prompt_ids``, read as an input logprob."""
    out = engine.generate(
        input_ids=prompt_ids + [label],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(prompt_ids),
    )
    return out["meta_info"]["input_token_logprobs"][0][0]


def test_score_matches_the_models_probabilities(smol_engine) -> None:
    tok = smol_engine.tokenizer
    query = "Question: is the sky blue? Answer:"
    items = [" yes", " maybe"]
    labels = [tok.encode(" Yes")[0], tok.encode(" No")[0], tok.encode(" It")[0]]
    raw = smol_engine.score(query=query, items=items, label_token_ids=labels)
    soft = smol_engine.score(
        query=query,
        items=items,
        label_token_ids=labels,
        apply_softmax=True,
        return_token_logprobs=True,
    )
    for i, item in enumerate(items):
        want = [_label_logprob(smol_engine, tok.encode(query + item), t) for t in labels]
        assert raw.scores[i] == pytest.approx([math.exp(lp) for lp in want], rel=1e-3)
        assert soft.token_logprobs[i] == pytest.approx(want, abs=1e-3)
        total = sum(math.exp(lp) for lp in want)
        assert soft.scores[i] == pytest.approx([math.exp(lp) / total for lp in want], rel=1e-3)
        assert sum(soft.scores[i]) == pytest.approx(1.0)
    assert raw.prompt_tokens == sum(len(tok.encode(query + item)) for item in items)
    again = asyncio.run(smol_engine.async_score(query=query, items=items, label_token_ids=labels))
    for row, want_row in zip(again.scores, raw.scores, strict=True):
        assert row == pytest.approx(want_row, rel=1e-4)


def test_score_refusals(smol_engine) -> None:
    args = {"query": "a", "items": ["b"], "label_token_ids": [5]}
    with pytest.raises(ValueError, match="return_pooled_hidden_states"):
        smol_engine.score(**args, return_pooled_hidden_states=True)
    assert smol_engine.score(**args, score_extraction_token_id=None).scores[0][0] > 0
    with pytest.raises(TypeError, match="no_such"):
        smol_engine.score(**args, no_such=1)
    with pytest.raises(ValueError, match="repeat"):
        smol_engine.score(query="a", items=["b"], label_token_ids=[5, 5])
    assert smol_engine.score(query="a", items=[], label_token_ids=[5]).scores == []


def test_items_share_the_query_prefix(smol_engine) -> None:
    """Items sent together compute a long query once: the others read it from the cache."""
    smol_engine.flush_cache()
    query = "A long instruction that every candidate item below continues in its turn. " * 4
    num_query = len(smol_engine.tokenizer.encode(query))
    assert num_query > 32  # the scheduler's in-batch sharing threshold
    result = smol_engine.score(query=query, items=[" a", " b", " c"], label_token_ids=[5])
    assert result.cached_tokens >= 2 * (num_query - 1)
