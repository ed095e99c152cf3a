"""int4 weight-only kernels: the quantizer against its definition, exact recovery of GGUF Q4_1
codes, the packed CPU matmul against the dequantized float32 matmul, and row dispatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels import gguf_cpu
from radixlm.kernels.int4_cpu import (
    GROUP_SIZE,
    Int4Codes,
    Int4Linear,
    can_pack_int4,
    dequantize_int4,
    int4_matmul,
    pack_int4,
    quantize_int4,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_quantize_follows_min_max_definition():
    w = torch.randn(48, 128, generator=gen(0)) * 0.05
    q = quantize_int4(w)
    groups = w.view(48, 4, GROUP_SIZE)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (48, 128)
    assert int(q.codes.max()) == 15 and int(q.codes.min()) == 0
    # scale and min are the float16 values nearest to the definition's
    mins, scales = groups.amin(-1), (groups.amax(-1) - groups.amin(-1)) / 15
    assert torch.equal(q.mins, mins.half().float()) and torch.equal(q.scales, scales.half().float())
    assert not torch.equal(q.mins, mins)  # rounded indeed
    codes = q.codes.view(48, 4, GROUP_SIZE)
    assert (codes.amin(-1) == 0).all() and (codes.amax(-1) == 15).all()  # min -> 0, max -> 15
    # the codes are picked for the rounded scale and min: half a step of error, and at the ends
    # of the range what the rounding moved them (at most 2**-11 relative each)
    err = (dequantize_int4(q) - w).view(48, 4, GROUP_SIZE).abs()
    rounding = (mins.abs() + 15 * scales) * 2**-11
    assert (err <= (q.scales / 2 * (1 + 1e-5) + rounding)[..., None]).all()
    inner = (codes > 0) & (codes < 15)  # away from the ends: half a step
    assert (err <= q.scales[..., None] / 2 * (1 + 1e-5) + 1e-7)[inner].all()


def test_flat_group_is_exact():
    w = torch.full((16, 64), 0.25)
    w[:, 32:] = torch.randn(16, 32, generator=gen(1))
    q = quantize_int4(w)
    assert (q.scales[:, 0] == 0).all() and (q.codes[:, :32] == 0).all()
    assert torch.equal(dequantize_int4(q)[:, :32], w[:, :32])


def q4_1_blocks(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """GGUF Q4_1 bytes for ``codes`` ``[blocks, 32]``: fp16 d, fp16 m, then 16 bytes holding
    elements 0..15 in the low nibbles and 16..31 in the high ones."""
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(-1, 2),
            m.astype(np.float16).view(np.uint8).reshape(-1, 2),
            qs.astype(np.uint8),
        ],
        axis=1,
    )


def test_requantizing_dequantized_q4_1_recovers_its_codes():
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    n, k = 64, 256
    blocks = n * k // GROUP_SIZE
    codes = rng.integers(0, 16, size=(blocks, GROUP_SIZE), dtype=np.uint8)
    # a Q4_1 quantizer maps each block's minimum to 0 and its maximum to 15
    rows = np.arange(blocks)
    lo, hi = rng.choice(GROUP_SIZE, size=(2, blocks), replace=True)
    hi = np.where(hi == lo, (lo + 1) % GROUP_SIZE, hi)
    codes[rows, lo], codes[rows, hi] = 0, 15
    d = rng.uniform(1e-3, 2e-2, size=blocks).astype(np.float16)
    m = rng.uniform(-0.2, 0.05, size=blocks).astype(np.float16)
    raw = q4_1_blocks(codes, d, m)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1).reshape(n, k).copy())

    q = quantize_int4(w)
    assert torch.equal(q.codes, torch.from_numpy(codes).reshape(n, k))
    # the file's float16 scales and mins exactly, and so the C++ kernels' packed weight
    assert torch.equal(q.mins.reshape(-1), torch.from_numpy(m.astype(np.float32)))
    assert torch.equal(q.scales.reshape(-1), torch.from_numpy(d.astype(np.float32)))
    packed = gguf_cpu.pack_q4_1(*q)
    assert packed.d.dtype == packed.m.dtype == torch.float16
    assert torch.equal(packed.d.reshape(-1), torch.from_numpy(d))
    assert torch.equal(packed.m.reshape(-1), torch.from_numpy(m))
    assert torch.equal(packed.codes.reshape(-1, 16), torch.from_numpy(raw[:, 4:]))  # GGUF's qs
    torch.testing.assert_close(dequantize_int4(q), w, rtol=0, atol=1e-6)


def bf16_reference(x: torch.Tensor, q: Int4Codes) -> torch.Tensor:
    """What the packed kernel computes: bf16 activations, (code - 8) * scale + zero' with scale
    and zero' rounded to bf16, accumulated in float32."""
    n, k = q.codes.shape
    scale = q.scales.to(torch.bfloat16).float()[..., None]
    zero = (q.mins + 8 * q.scales).to(torch.bfloat16).float()[..., None]
    w = ((q.codes.float().view(n, -1, GROUP_SIZE) - 8) * scale + zero).view(n, k)
    return x.to(torch.bfloat16).float() @ w.t()


@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (3, 256, 576), (8, 160, 1536), (17, 64, 96)])
def test_int4_matmul_matches_dequantized_matmul(m, n, k):
    w = torch.randn(n, k, generator=gen(m + n)) * 0.05
    x = torch.randn(m, k, generator=gen(k))
    q = quantize_int4(w)
    out = int4_matmul(x, pack_int4(q))
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    out = out.float()
    # the kernel's own arithmetic: only the bf16 rounding of the output is left
    exact = bf16_reference(x, q)
    torch.testing.assert_close(out, exact, rtol=2**-7, atol=1e-3 * exact.abs().max().item())
    # against float32 activations and float32 scales: bf16 rounding of activations, scales,
    # zeros and the output, each about 2**-9 relative, summed over k terms of mixed sign
    ref = x @ dequantize_int4(q).t()
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_strided_activations_are_accepted():
    w = torch.randn(32, 64, generator=gen(5))
    x = torch.randn(64, 4, generator=gen(6))[:, :2].t()  # [2, 64], not contiguous
    packed = pack_int4(quantize_int4(w))
    assert torch.equal(int4_matmul(x, packed), int4_matmul(x.contiguous(), packed))


def test_linear_dispatches_on_rows():
    w = torch.randn(64, 128, generator=gen(7)) * 0.05
    bias = torch.randn(64, generator=gen(8))
    layer = Int4Linear(w, bias, max_int4_rows=2)
    for rows in (1, 2, 3, 9):
        x = torch.randn(rows, 128, generator=gen(rows))
        out = layer(x)
        assert out.dtype == torch.float32 and out.shape == (rows, 64)
        dense = F.linear(x, w, bias)
        if rows <= 2:  # int4 path: close to the dense layer, but not equal
            if gguf_cpu.available():  # the C++ Q4_1 GEMV, torch's packed kernel when off
                int4 = gguf_cpu.q4_1_matmul(x, layer.q4_1) + bias
                with gguf_cpu.disabled():
                    off = layer(x)
                torch.testing.assert_close(off, int4_matmul(x, layer.packed).float() + bias)
            else:
                int4 = int4_matmul(x, layer.packed).float() + bias
            torch.testing.assert_close(out, int4)
            assert not torch.equal(out, dense)
        else:
            assert torch.equal(out, dense)
    x3d = torch.randn(1, 2, 128, generator=gen(9))
    assert torch.equal(layer(x3d), layer(x3d.view(2, 128)).view(1, 2, 64))


def test_unpackable_shapes_are_rejected():
    assert can_pack_int4(48, 64) and not can_pack_int4(300, 64) and not can_pack_int4(64, 48)
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4Linear(torch.randn(300, 64))
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(16, 48))
    with pytest.raises(ValueError, match="float16's range"):  # scales and mins are float16
        quantize_int4(torch.full((16, 32), 1e5))
