from __future__ import annotations

import pytest
import torch

from radixlm.srt.sampling.logprobs import input_token_logprobs, token_logprobs, top_logprobs


def test_token_logprobs_equal_log_softmax_gather() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.tensor([0, 10, 3, 3, 7])
    expected = torch.log_softmax(logits, -1)[torch.arange(5), ids]
    assert torch.allclose(token_logprobs(logits, ids), expected)
    # Half-precision logits are upcast; the input is not modified.
    half = logits.to(torch.bfloat16)
    out = token_logprobs(half, ids)
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.log_softmax(half.float(), -1)[torch.arange(5), ids])


def test_token_logprobs_hand_computed() -> None:
    logits = torch.tensor([[0.0, 0.0], [0.0, 3.0]])
    out = token_logprobs(logits, torch.tensor([1, 0]))
    assert torch.allclose(
        out,
        torch.tensor([-torch.log(torch.tensor(2.0)), -torch.log1p(torch.exp(torch.tensor(3.0)))]),
    )


def test_top_logprobs_sorted_and_consistent() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    values, ids = top_logprobs(logits, 2)
    assert ids.tolist() == [[1, 2], [2, 3]]
    assert torch.allclose(
        values, token_logprobs(logits.repeat_interleave(2, 0), ids.flatten()).view(2, 2)
    )
    values, ids = top_logprobs(logits, 0)
    assert values.shape == (2, 0) and ids.shape == (2, 0)
    assert top_logprobs(logits, 10)[1].shape == (2, 4)


def _reference(prompt_logits: torch.Tensor, ids: list[int], i: int) -> float:
    return torch.log_softmax(prompt_logits[i - 1], -1)[ids[i]].item()


@pytest.mark.parametrize("start", [0, 1, 3, 5])
def test_input_token_logprobs(start: int) -> None:
    ids = [4, 1, 0, 6, 2]
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    out = input_token_logprobs(logits, ids, start)
    assert len(out) == len(ids) - start
    if start == 0:
        assert out[0] is None
    for i in range(max(start, 1), len(ids)):
        assert out[i - start] == pytest.approx(_reference(logits, ids, i), abs=1e-6)


def test_input_token_logprobs_with_partial_logits() -> None:
    ids = [4, 1, 0, 6, 2]
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(2))
    # Only the logits from position 2 on were computed.
    out = input_token_logprobs(logits[2:], ids, start=3, logits_start=2)
    assert out == pytest.approx([_reference(logits, ids, 3), _reference(logits, ids, 4)])
    with pytest.raises(AssertionError):
        input_token_logprobs(logits[2:], ids, start=1, logits_start=2)
    assert input_token_logprobs(logits[:1], [9], 0) == [None]


def test_row_blocks_give_the_whole_tensor_results(monkeypatch) -> None:
    """Log-probabilities are computed ROW_BLOCK rows at a time (bounded float32 temporaries
    for long prompt chunks); results equal the one-shot log_softmax, across block edges."""
    from radixlm.srt.sampling import logprobs as lp_mod

    monkeypatch.setattr(lp_mod, "ROW_BLOCK", 3)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 17, generator=g) * 4
    full = torch.log_softmax(logits, -1)
    ids = torch.randint(0, 17, (8,), generator=g)
    assert torch.allclose(lp_mod.token_logprobs(logits, ids), full[torch.arange(8), ids])
    values, top_ids = lp_mod.top_logprobs(logits, 4)
    ref_v, ref_i = full.topk(4, dim=-1)
    assert torch.equal(top_ids, ref_i) and torch.allclose(values, ref_v)
    rows = lp_mod.token_ids_logprob_rows(logits, [5, 0, 16])
    assert len(rows) == 8
    for r, row in enumerate(rows):
        assert [t for _, t in row] == [5, 0, 16]
        assert torch.allclose(torch.tensor([v for v, _ in row]), full[r, [5, 0, 16]])
    assert lp_mod.top_logprobs(logits[:0], 2)[0].shape == (0, 2)
