"""Per-channel int8 weights: the quantizer against its definition and the packed CPU matmul
against the dequantized float32 matmul."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.int8_cpu import (
    can_use_packed_int8,
    dequantize_int8,
    int8_matmul,
    quantize_int8,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_quantize_follows_per_row_definition():
    w = torch.randn(40, 96, generator=gen(0)) * 0.1
    w[3] = 0.0
    q = quantize_int8(w)
    assert q.codes.dtype == torch.int8 and q.scales.shape == (40,)
    torch.testing.assert_close(q.scales, w.abs().amax(1) / 127, rtol=0, atol=0)
    assert (q.codes.abs().amax(1)[torch.arange(40) != 3] == 127).all()  # each row's max -> 127
    assert (q.codes[3] == 0).all() and q.scales[3] == 0
    err = (dequantize_int8(q) - w).abs()
    assert (err <= q.scales[:, None] / 2 * (1 + 1e-5)).all()


# K=200, 56 and 100 crash or give NaN in torch's packed kernel on AVX-512 CPUs: they must take
# the guarded path and still give the right numbers.
@pytest.mark.parametrize(
    "m,n,k", [(1, 300, 64), (4, 512, 576), (9, 64, 200), (1, 64, 56), (1, 64, 100), (3, 17, 40)]
)
def test_int8_matmul_matches_dequantized_matmul(m, n, k):
    w = torch.randn(n, k, generator=gen(n)) * 0.05
    x = torch.randn(m, k, generator=gen(k))
    q = quantize_int8(w)
    scales = q.scales.to(torch.bfloat16)
    out = int8_matmul(x, q.codes, scales)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    out = out.float()
    # the kernel's own arithmetic: bf16 activations and scales, float32 sums, bf16 output
    exact = (x.to(torch.bfloat16).float() @ q.codes.float().t()) * scales.float()
    torch.testing.assert_close(out, exact, rtol=2**-7, atol=1e-3 * exact.abs().max().item())
    ref = x @ dequantize_int8(q).t()
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_packed_kernel_guard_by_reduction_size():
    assert can_use_packed_int8(576) and can_use_packed_int8(16)
    assert not can_use_packed_int8(200) and not can_use_packed_int8(56)
    assert not can_use_packed_int8(0)
