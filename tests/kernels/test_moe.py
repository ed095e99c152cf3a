"""The grouped-by-expert torch path equals the dense all-experts reference: uneven loads, an
expert with no tokens, choices held by another rank (-1), bfloat16."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.moe import dense_experts_reference, grouped_experts

HIDDEN, INTER, EXPERTS, TOP_K = 16, 24, 8, 2


def _case(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2).to(dtype)
    # skewed choices: expert 0 takes most tokens, expert 5 none
    probs = torch.tensor([8.0, 2, 1, 1, 1, 0, 1, 1])
    ids = torch.stack(
        [torch.multinomial(probs, TOP_K, generator=g) for _ in range(num_tokens)]
        or [torch.zeros(0, TOP_K, dtype=torch.int64)]
    ).view(num_tokens, TOP_K)
    weights = torch.rand(num_tokens, TOP_K, generator=g)
    return x, gate_up, down, ids, weights


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
def test_grouped_equals_dense_reference(num_tokens):
    x, gate_up, down, ids, weights = _case(num_tokens, torch.float32)
    assert not (ids == 5).any()
    got = grouped_experts(x, gate_up, down, ids, weights)
    want = dense_experts_reference(x, gate_up, down, ids, weights)
    assert got.shape == (num_tokens, HIDDEN) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_choices_held_elsewhere_add_nothing():
    x, gate_up, down, ids, weights = _case(20, torch.float32, seed=1)
    ids[::3, 0] = -1
    ids[5] = -1  # a token with no local choice: zeros
    got = grouped_experts(x, gate_up, down, ids, weights)
    torch.testing.assert_close(got, dense_experts_reference(x, gate_up, down, ids, weights))
    assert got[5].abs().max() == 0


def test_bfloat16_is_close_to_float32():
    x, gate_up, down, ids, weights = _case(33, torch.bfloat16, seed=2)
    got = grouped_experts(x, gate_up, down, ids, weights)
    want = dense_experts_reference(x.float(), gate_up.float(), down.float(), ids, weights)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_empty_batch():
    x, gate_up, down, ids, weights = _case(0, torch.float32)
    assert grouped_experts(x, gate_up, down, ids, weights).shape == (0, HIDDEN)
