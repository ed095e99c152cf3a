"""The packed-bitmask kernel (Triton, interpreted without CUDA) against a per-token reference."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is first wrapped

from radixlm.kernels.bitmask import (  # noqa: E402
    apply_token_bitmask_inplace,
    apply_token_bitmask_inplace_lut,
    apply_token_bitmask_inplace_torch,
    unpack_bitmask,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_bitmask(rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 2**32, (rows, words), generator=gen, dtype=torch.int64)
    return (raw - (raw >= 2**31).long() * 2**32).to(torch.int32)  # full int32 range, sign bit too


def per_token_reference(logits, bitmask, rows=None):
    """Token t allowed iff bit t % 32 of word t // 32 is set; tokens past the mask disallowed."""
    out = logits.clone()
    words = bitmask.shape[1]
    for r in range(bitmask.shape[0]) if rows is None else rows.tolist():
        for t in range(logits.shape[1]):
            w = t // 32
            allowed = w < words and (int(bitmask[r, w]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


def test_unpack_bit_order():
    mask = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    allowed = unpack_bitmask(mask, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 63]


@pytest.mark.parametrize("vocab,words", [(100, 4), (64, 2), (70, 2), (45, 3)])
def test_torch_fallback_matches_reference(vocab, words):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn((3, vocab), generator=gen)
    mask = random_bitmask(3, words, gen)
    expected = per_token_reference(logits, mask)
    apply_token_bitmask_inplace_torch(logits, mask)
    assert torch.equal(logits, expected)


# Widths: whole words, a partial last byte, a partial word, a mask short of the vocabulary,
# a mask wider than it, fewer than 8 tokens.
@pytest.mark.parametrize("vocab,words", [(128, 4), (100, 4), (70, 2), (45, 3), (96, 2), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [3, 0]])
def test_lut_path_matches_reference(vocab, words, dtype, rows):
    gen = torch.Generator().manual_seed(vocab * words)
    logits = torch.randn((5, vocab), generator=gen).to(dtype)
    logits[:, 1] = float("inf")  # an infinite logit: kept if allowed, -inf if not
    mask = random_bitmask(5, words, gen)
    index = None if rows is None else torch.tensor(rows)
    expected = per_token_reference(logits, mask, index)
    apply_token_bitmask_inplace_lut(logits, mask, index)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_torch(dtype):
    pytest.importorskip("triton")
    from radixlm.kernels.bitmask import apply_token_bitmask_inplace_triton

    gen = torch.Generator().manual_seed(1)
    vocab = 5000  # two blocks, the last one partial; mask one word short of the vocabulary
    logits = torch.randn((4, vocab), generator=gen).to(DEVICE, dtype)
    mask = random_bitmask(4, vocab // 32, gen).to(DEVICE)
    expected = logits.clone()
    apply_token_bitmask_inplace_torch(expected, mask)
    apply_token_bitmask_inplace_triton(logits, mask)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[:, (vocab // 32) * 32 :]).all()


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_only_selected_rows_are_masked(path):
    if path == "triton":
        pytest.importorskip("triton")
    from radixlm.kernels import bitmask as bm

    apply = getattr(bm, f"apply_token_bitmask_inplace_{path}")
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn((5, 300), generator=gen).to(DEVICE)
    mask = random_bitmask(5, 10, gen).to(DEVICE)
    rows = torch.tensor([3, 0], device=DEVICE)
    expected = per_token_reference(logits.cpu(), mask.cpu(), rows.cpu())
    apply(logits, mask, rows)
    assert torch.equal(logits.cpu(), expected)
    assert torch.isfinite(logits[[1, 2, 4]]).all()  # rows not selected are untouched


def test_dispatch_and_validation():
    logits = torch.zeros((2, 40))
    mask = torch.zeros((2, 2), dtype=torch.int32)
    mask[1, 0] = 1
    apply_token_bitmask_inplace(logits, mask)
    assert torch.isinf(logits[0]).all() and logits[1, 0] == 0 and torch.isinf(logits[1, 1:]).all()
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_inplace(logits, mask.long())
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_inplace(logits, mask[:1])
    apply_token_bitmask_inplace(logits.fill_(0), mask, rows=[1])
    assert logits[0].eq(0).all() and logits[1, 0] == 0 and torch.isinf(logits[1, 1:]).all()
    apply_token_bitmask_inplace(logits, mask, rows=[])  # nothing selected: a no-op
    assert logits[0].eq(0).all()
