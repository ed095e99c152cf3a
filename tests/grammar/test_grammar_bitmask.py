"""Packed bitmask helpers against plain reference loops."""

from __future__ import annotations

import pytest
import torch

from radixlm.grammar.bitmask import (
    allocate_token_bitmask,
    allowed_token_ids,
    apply_token_bitmask_inplace,
    bitmask_width,
    fill_all_allowed,
    pack_token_ids,
    unpack_bitmask,
)


def _bit(bitmask: torch.Tensor, row: int, token: int) -> bool:
    word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
    return bool((word >> (token % 32)) & 1)


def _reference_apply(logits, bitmask, rows):
    out = logits.clone()
    for row in rows:
        for token in range(logits.shape[1]):
            if token >= 32 * bitmask.shape[1] or not _bit(bitmask, row, token):
                out[row, token] = float("-inf")
    return out


def _random_bitmask(generator, batch, width):
    return torch.randint(
        -(2**31), 2**31 - 1, (batch, width), dtype=torch.int32, generator=generator
    )


@pytest.mark.parametrize(
    ("batch", "vocab_size", "width"),
    [(1, 32, 1), (4, 77, 3), (3, 100, 2), (2, 64, 5)],  # exact, padded, too narrow, too wide
)
def test_apply_matches_reference_loop(batch, vocab_size, width):
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(batch, vocab_size, generator=generator)
    bitmask = _random_bitmask(generator, batch, width)
    expected = _reference_apply(logits, bitmask, range(batch))
    apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(logits, expected)


def test_apply_to_selected_rows_only():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=generator, dtype=torch.float64)
    bitmask = _random_bitmask(generator, 5, bitmask_width(70))
    expected = _reference_apply(logits, bitmask, [1, 3])
    apply_token_bitmask_inplace(logits, bitmask, rows=[1, 3])
    assert torch.equal(logits, expected)
    untouched = logits.clone()
    apply_token_bitmask_inplace(logits, bitmask, rows=[])
    assert torch.equal(logits, untouched)


def test_apply_rejects_bad_shapes():
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_inplace(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_inplace(torch.zeros(2, 32), torch.zeros(1, 1, dtype=torch.int32))


def test_pack_unpack_round_trip():
    ids = [0, 1, 31, 32, 63, 64, 99]
    row = pack_token_ids(ids, 100)
    assert row.dtype == torch.int32 and row.shape == (4,)
    assert int(row[0]) == -(2**31) + 3  # bits 0, 1 and 31: the sign bit is token 31
    assert allowed_token_ids(row.unsqueeze(0), 0, 100) == ids
    assert unpack_bitmask(row, 100).nonzero().flatten().tolist() == ids
    assert unpack_bitmask(row, 140)[100:].any().item() is False  # past the mask: disallowed


def test_allocate_and_fill_all_allowed():
    bitmask = allocate_token_bitmask(3, 65)
    assert bitmask.shape == (3, 3) and bitmask.dtype == torch.int32
    assert allowed_token_ids(bitmask, 2, 65) == list(range(65))
    bitmask.zero_()
    fill_all_allowed(bitmask, 1)
    assert allowed_token_ids(bitmask, 0, 65) == []
    assert allowed_token_ids(bitmask, 1, 65) == list(range(65))
