"""The fused MoE kernel (Triton; interpreted without CUDA) against the torch reference of
``kernels/moe.py`` on fresh random inputs: uneven expert loads, an expert with no tokens,
choices held by another rank; bfloat16 on the GPU at several token counts."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is first wrapped

from radixlm.kernels.fused_moe import align_by_expert, fused_experts  # noqa: E402
from radixlm.kernels.moe import grouped_experts  # noqa: E402

# expert 0 takes most tokens, expert 5 none
SKEW = [8.0, 2, 1, 1, 1, 0, 1, 1]


def _case(tokens, hidden, inter, experts, top_k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    probs = torch.tensor((SKEW * experts)[:experts])
    ids = torch.stack([torch.multinomial(probs, top_k, generator=g) for _ in range(tokens)]).view(
        tokens, top_k
    )
    weights = torch.rand(tokens, top_k, generator=g)
    to = dict(device=device)
    return (
        x.to(dtype=dtype, **to),
        gate_up.to(dtype=dtype, **to),
        down.to(dtype=dtype, **to),
        ids.to(**to),
        weights.to(**to),
    )


def test_align_groups_choices_by_expert_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [-1, 2]])
    sorted_choices, block_expert = align_by_expert(ids, num_experts=4, block_m=4)
    blocks = sorted_choices.view(-1, 4).tolist()
    sentinel = ids.numel()
    assert block_expert.tolist()[:3] == [0, 2, 3]
    assert blocks[0] == [1, sentinel, sentinel, sentinel]  # expert 0: choice 1
    assert blocks[1] == [0, 2, 5, sentinel]  # expert 2: choices 0, 2, 5 in order
    assert blocks[2] == [3, sentinel, sentinel, sentinel]
    assert all(e == -1 for e in block_expert.tolist()[3:])  # unused tail; -1 choice dropped
    assert 4 not in sorted_choices.tolist()


@pytest.mark.slow  # about 15 s under the interpreter
def test_fused_equals_torch_reference_interpreted():
    """fp32 (the interpreter's tl.dot is wrong in bf16), two token counts."""
    for tokens in (5, 40):
        x, gate_up, down, ids, weights = _case(tokens, 32, 32, 8, 2, torch.float32, "cpu")
        ids[1, 1] = -1  # held by another rank
        got = fused_experts(x, gate_up, down, ids, weights)
        want = grouped_experts(x, gate_up, down, ids, weights)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 333, 2048])
def test_fused_equals_torch_reference_bf16(tokens):
    x, gate_up, down, ids, weights = _case(tokens, 256, 192, 16, 4, torch.bfloat16, "cuda")
    ids[::7, -1] = -1
    got = fused_experts(x, gate_up, down, ids, weights)
    want = grouped_experts(x.float(), gate_up.float(), down.float(), ids, weights)
    assert not (ids == 5).any()  # an expert with no tokens
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
