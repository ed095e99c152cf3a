"""The int4 weight-only matmul with packed nibble conversion (``kernels/int4_mm.py``) against the
torch reference (``F.linear`` with the weight dequantised in fp32).

CPU: the kernel under the Triton interpreter (its plain-Triton conversion; fp16) with several
groups a tile and one group over several tiles, split K (uneven, and with an empty split) and its arrival counts left at
zero, rows over one ``BLOCK_M``. GPU (``gpu``): the inline-assembly conversion gives the same
output as the plain one, split K replays in a CUDA graph, and the dispatch (``int4_linear``)
on the Llama-3-8B projections at rows 1, 4, 16 and 64, group 128, bf16 and fp16.

Tolerance, relative to the largest reference value: the kernel multiplies the exact ``q - z``
and applies the scale in fp32; the output is rounded once: 2e-2 for bf16, 4e-3 for fp16 (as
``test_quant_gemm.py``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is first wrapped

from radixlm.kernels import int4_mm as im  # noqa: E402
from radixlm.kernels import quant_gemm as qg  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _weights(n, k, group, dtype, seed=0):
    """Random int4 weights in the kernel layout; zeros 0..16 (GPTQ's ``zero + 1`` reaches 16)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)  # made where they are used: 8B shapes
    values = torch.randint(0, 16, (n, k), generator=g, device=DEVICE, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=g, device=DEVICE) * 0.02 + 0.005
    zeros = torch.randint(0, 17, (n, k // group), generator=g, device=DEVICE)
    return qg.pack_int4(values, 1), scales.to(dtype), zeros.to(dtype)


def _check(m, n, k, group, dtype, cfg=None, seed=0):
    qweight, scales, zeros = _weights(n, k, group, dtype, seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    want = F.linear(x.float(), qg.dequantize_int4(qweight, scales, zeros))
    got = im.int4_mm(x, qweight, scales, zeros, cfg=cfg)
    assert got.dtype == dtype and got.shape == (m, n)
    assert _rel(got, want) < TOL[dtype], cfg
    return got


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "cfg"),
    [
        (1, 40, 512, 32, None),  # four groups a tile, N not a multiple of BLOCK_N
        (3, 40, 512, 128, {"BLOCK_K": 64, "SPLIT_K": 1}),  # a group over two tiles
        (5, 24, 640, 128, {"SPLIT_K": 2}),  # five tiles in two splits (3 + 2)
        (3, 24, 768, 384, {"SPLIT_K": 4}),  # six tiles in four splits: one split is empty
        (2, 40, 512, 32, {"BLOCK_K": 16, "SPLIT_K": 3}),  # a group over two tiles
        (4, 24, 512, 64, {"BLOCK_K": 256, "SPLIT_K": 1, "BLOCK_N": 16}),  # four groups a tile
        (20, 72, 256, 64, {"BLOCK_M": 16, "SPLIT_K": 1}),  # rows over two BLOCK_M tiles
    ],
)
def test_int4_mm_matches_the_reference(m, n, k, group, cfg):
    _check(m, n, k, group, torch.float16, cfg)


def test_int4_mm_split_counts_are_left_at_zero_for_the_next_launch():
    """The last program of each split tile resets its count: a second launch (and a third with
    another split) computes the same result."""
    first = _check(3, 40, 512, 128, torch.float16, {"SPLIT_K": 4, "BLOCK_N": 16})
    again = _check(3, 40, 512, 128, torch.float16, {"SPLIT_K": 4, "BLOCK_N": 16})
    assert torch.equal(first, again)  # the parts are added in one order: deterministic
    _check(3, 40, 512, 128, torch.float16, {"SPLIT_K": 2})
    assert not im._counts(torch.device(DEVICE), 1).any()


@pytest.mark.parametrize("mm_rows", [0, 16])
def test_int4_linear_takes_int4_mm_up_to_mm_rows(mm_rows, monkeypatch):
    """``MM_ROWS`` decides: int4_mm up to it, the older kernels above; the same values."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return im.int4_mm(*args, **kwargs)

    monkeypatch.setattr(qg, "MM_ROWS", mm_rows)
    monkeypatch.setattr(qg, "int4_mm", spy)
    qweight, scales, zeros = _weights(40, 256, 128, torch.float16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    x = x.to(DEVICE)
    got = qg.int4_linear(x, qweight, scales, zeros)
    assert calls == ([3] if mm_rows >= 3 else [])
    want = F.linear(x.float(), qg.dequantize_int4(qweight, scales, zeros))
    assert _rel(got, want) < TOL[torch.float16]


def test_int4_mm_config_fits_the_groups_and_refuses_tiles_that_do_not():
    for group in (32, 64, 128, 384, 14336):
        for m in (1, 16, 64, 128):
            for n, k in ((4096, 14336), (6144, 4096)):
                if k % group:
                    continue
                c = im.int4_mm_config(m, n, k, group)
                assert im.tile_fits(c["BLOCK_K"], k, group)
                assert 16 <= c["BLOCK_M"] <= 128 and c["BLOCK_M"] >= min(m, 128)
                ktiles = k // c["BLOCK_K"]
                per_split = -(-ktiles // c["SPLIT_K"])
                assert 1 <= c["SPLIT_K"] <= 16 and (c["SPLIT_K"] - 1) * per_split < ktiles
    assert not im.tile_fits(256, 768, 384) and im.tile_fits(128, 768, 384)
    assert im.tile_fits(128, 4096, 32) and im.tile_fits(128, 4096, 64)  # groups a tile
    assert not im.tile_fits(128, 4096, 96) and not im.tile_fits(8, 64, 64)
    qweight, scales, zeros = _weights(8, 768, 384, torch.float16)
    x = torch.zeros(1, 768, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="BLOCK_K 256"):
        im.int4_mm(x, qweight, scales, zeros, cfg={"BLOCK_K": 256})


# --- GPU ------------------------------------------------------------------------------------

EIGHT_B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="inline assembly needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [{"SPLIT_K": 1}, {"SPLIT_K": 8}, {"BLOCK_M": 64, "SPLIT_K": 3}])
def test_gpu_packed_conversion_equals_the_plain_one(dtype, cfg):
    """The same operand (``q - z``, exact) either way, split parts added in one order: equal
    outputs."""
    qweight, scales, zeros = _weights(4096, 4096, 128, dtype)
    x = torch.randn(4, 4096, device="cuda").to(dtype)
    fast = im.int4_mm(x, qweight, scales, zeros, cfg={**cfg, "ASM": True})
    plain = im.int4_mm(x, qweight, scales, zeros, cfg={**cfg, "ASM": False})
    assert torch.equal(fast, plain)
    _check(4, 4096, 4096, 128, dtype, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_int4_mm_replays_in_a_cuda_graph_with_split_k():
    qweight, scales, zeros = _weights(4096, 4096, 128, torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    cfg = {"SPLIT_K": 8}
    im.int4_mm(x, qweight, scales, zeros, cfg=cfg)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = im.int4_mm(x, qweight, scales, zeros, cfg=cfg)
    for _ in range(3):  # the counts are reset by each replay's last programs
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, im.int4_mm(x, qweight, scales, zeros, cfg=cfg))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize(("n", "k"), EIGHT_B)
def test_gpu_int4_linear_on_the_8b_projections(dtype, m, n, k, monkeypatch):
    monkeypatch.setattr(qg, "MM_ROWS", qg.DEQUANT_ROWS)  # the dispatch int4_mm is meant for
    qweight, scales, zeros = _weights(n, k, 128, dtype, seed=m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    want = F.linear(x.float(), qg.dequantize_int4(qweight, scales, zeros))
    got = qg.int4_linear(x, qweight, scales, zeros)
    assert got.dtype == dtype and got.shape == (m, n)
    assert _rel(got, want) < TOL[dtype]
