from __future__ import annotations

import torch

from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.sampling.penalties import (
    LogitBias,
    PenaltyInputs,
    apply_frequency_presence,
    apply_repetition,
    sparse_rows,
    suppress_tokens,
    token_counts,
)


def test_token_counts_ragged_rows() -> None:
    counts = token_counts([[1, 1, 3], [], [0]], 4, "cpu")
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]
    assert token_counts([[], []], 3, "cpu").tolist() == [[0, 0, 0], [0, 0, 0]]
    assert token_counts([], 3, "cpu").shape == (0, 3)


def test_frequency_presence_hand_computed() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    counts = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 0.0]])
    apply_frequency_presence(
        logits, counts, torch.tensor([[0.5], [-1.0]]), torch.tensor([[0.25], [0.0]])
    )
    assert logits.tolist() == [[1 - 1.5 - 0.25, 1 - 0.5 - 0.25, 1.0], [1.0, 3.0, 1.0]]


def test_repetition_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0], [2.0, -2.0, 2.0, -2.0]])
    seen = torch.tensor([[True, True, False, False], [True, True, False, False]])
    apply_repetition(logits, seen, torch.tensor([[2.0], [0.5]]))
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0], [4.0, -1.0, 2.0, -2.0]]


def test_penalty_inputs_built_only_when_used() -> None:
    plain = [SamplingParams(), SamplingParams(temperature=0.0)]
    assert PenaltyInputs.build(plain, [[1], [2]], 5, "cpu") is None
    only_rep = PenaltyInputs.build(
        [SamplingParams(repetition_penalty=1.2)], [[1]], 5, "cpu", prompt_ids=[[4, 4]]
    )
    assert only_rep is not None and only_rep.output_counts is None
    assert only_rep.seen_mask is not None
    assert only_rep.seen_mask.tolist() == [[False, True, False, False, True]]
    only_freq = PenaltyInputs.build([SamplingParams(frequency_penalty=0.1)], [[1]], 5, "cpu")
    assert only_freq is not None and only_freq.seen_mask is None
    assert only_freq.output_counts is not None


def test_logit_bias_and_suppression() -> None:
    bias = LogitBias.build(
        [
            SamplingParams(logit_bias={"1": 1.5}),
            SamplingParams(),
            SamplingParams(logit_bias={0: -2.0, 2: 0.5}),
        ],
        "cpu",
    )
    assert bias is not None
    logits = torch.zeros(3, 3)
    bias.apply(logits)
    assert logits.tolist() == [[0.0, 1.5, 0.0], [0.0, 0.0, 0.0], [-2.0, 0.0, 0.5]]
    assert LogitBias.build([SamplingParams()], "cpu") is None
    index = sparse_rows([[2], None, [0, 1]], "cpu")
    assert index is not None
    suppress_tokens(logits, index)
    inf = float("-inf")
    assert logits.tolist() == [[0.0, 1.5, inf], [0.0, 0.0, 0.0], [inf, inf, 0.5]]
    assert sparse_rows([[], None], "cpu") is None
