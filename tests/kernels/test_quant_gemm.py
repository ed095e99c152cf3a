"""Quantised linear kernels against their torch references (``kernels/quant_gemm.py`` and its
decode-row GEMVs, ``kernels/quant_gemv.py``).

CPU: int4 packing round trips, dequantisation, activation quantisation per token / block /
static; the int4 (fp16, tiled and GEMV), FP8 block (fp32 out) and FP8 GEMV Triton kernels
under the interpreter. GPU (``gpu``): ``torch._scaled_mm``
per channel and per tensor, the FP8 block kernel and the int4 kernel (bf16 and fp16, GEMV
rows with split K and GEMM tiles) against the reference on the same quantised inputs.

Tolerances, relative to the largest reference value: the kernels and the reference quantise the
activations identically and sum in fp32 in another order; the outputs are rounded once to
bf16 (2^-8) or fp16 (2^-11), and the int4 kernel rounds each dequantised weight to the
activation dtype before the dot (the reference keeps it in fp32): 2e-2 for bf16, 4e-3 fp16.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is first wrapped

from radixlm.kernels import quant_gemm as qg  # noqa: E402
from radixlm.kernels import quant_gemv as qv  # noqa: E402

CUDA = torch.cuda.is_available()
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _int4_weights(n, k, group, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=g)
    groups = k // group
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), generator=g).to(dtype)
    qweight = qg.pack_int4(values, 1)
    return values, qweight.to(device), scales.to(device), zeros.to(device)


def test_int4_packing_round_trips_in_any_nibble_order():
    values = torch.randint(0, 16, (5, 64))
    for order in (qg.SEQUENTIAL, (0, 2, 4, 6, 1, 3, 5, 7)):
        for dim in (0, 1):
            v = values if dim == 1 else values.t().contiguous()
            packed = qg.pack_int4(v, dim, order)
            assert packed.dtype == torch.int32
            assert torch.equal(qg.unpack_int4(packed, dim, order), v.to(torch.uint8))


def test_sequential_packing_puts_feature_8c_plus_i_in_nibble_i():
    values = torch.arange(16).repeat(1, 1)[:, :8]  # features 0..7 = values 0..7
    word = int(qg.pack_int4(values, 1)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(range(8))


def test_dequantize_int4_applies_groups_and_puts_act_order_columns_back():
    values, qweight, scales, zeros = _int4_weights(4, 64, 32, torch.float32, "cpu")
    want = (values.float() - zeros.repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    assert torch.equal(qg.dequantize_int4(qweight, scales, zeros), want)
    perm = torch.randperm(64)
    dense = qg.dequantize_int4(qweight, scales, zeros, perm)
    assert torch.equal(dense[:, perm], want)


@pytest.mark.parametrize("mode", ["token", "block", "static"])
def test_activation_quantisation_scales_and_error(mode):
    x = torch.randn(6, 200) * torch.logspace(-2, 1, 6)[:, None]
    scale_in = torch.tensor([0.03])
    q, scale = qg.quantize_activations(x, mode, 64, scale_in)
    assert q.dtype == qg.FP8_DTYPE and q.shape == x.shape
    assert scale.shape == ((6, 4) if mode == "block" else (6, 1))
    per_feature = scale if mode != "block" else scale.repeat_interleave(64, 1)[:, :200]
    back = q.float() * per_feature
    if mode == "static":
        clipped = x.clamp(-448 * 0.03, 448 * 0.03)
        assert float((back - clipped).abs().max()) <= 0.0625 * 448 * 0.03
    else:  # e4m3: relative rounding error at most 2^-4 above the subnormals
        assert float(((back - x).abs() - 0.0625 * x.abs()).max()) <= float(scale.max()) * 2**-9


def test_fp8_block_scales_cover_128_features_with_a_partial_last_block():
    k = 200  # blocks [0, 128) and [128, 200)
    w8 = torch.randn(3, k).to(qg.FP8_DTYPE)
    scale = torch.tensor([[1.0, 2.0]] * 3)
    dense = qg.dequantize_fp8(w8, scale, block_k=128)
    assert torch.equal(dense[:, :128], w8[:, :128].float())
    assert torch.equal(dense[:, 128:], 2 * w8[:, 128:].float())
    x = torch.zeros(1, k)
    x[0, 130] = 1.0  # only the second block: its activation scale is 1 / 448
    y = qg.fp8_linear_reference(x, w8, scale, "block", 128, None)
    torch.testing.assert_close(y[0], dense[:, 130])
    with pytest.raises(ValueError, match="do not fit"):
        qg.dequantize_fp8(w8, torch.ones(3, 3), block_k=128)


@pytest.mark.parametrize("m", [1, 3, 17, 40])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_kernel_matches_the_reference(m, group):
    if not CUDA and m > 17:
        pytest.skip("interpreter: small shapes only")
    device = "cuda" if CUDA else "cpu"
    dtype = torch.float16
    n, k = 72, 256  # N not a multiple of BLOCK_N
    _, qweight, scales, zeros = _int4_weights(n, k, group, dtype, device, seed=m + group)
    x = torch.randn(m, k, device=device).to(dtype)
    assert qg.int4_supported(x, qweight, scales)
    want = F.linear(x.float(), qg.dequantize_int4(qweight, scales, zeros))
    got = qg.int4_gemm(x, qweight, scales, zeros)
    assert got.dtype == dtype and got.shape == (m, n)
    assert _rel(got, want) < TOL[dtype]


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_tiled_kernel_serves_decode_rows_with_split_k(m, group):
    """The tiled kernel at decode rows (split K, atomic fp32 sums), which the GEMV kernel
    takes over by default: forced through its config."""
    device = "cuda" if CUDA else "cpu"
    n, k = 40, 512
    _, qweight, scales, zeros = _int4_weights(n, k, group, torch.float16, device, seed=m)
    x = torch.randn(m, k, device=device).to(torch.float16)
    cfg = qg.int4_config(m, n, k, group)
    assert cfg["SPLIT_K"] > 1
    want = F.linear(x.float(), qg.dequantize_int4(qweight, scales, zeros))
    assert _rel(qg.int4_gemm(x, qweight, scales, zeros, cfg=cfg), want) < TOL[torch.float16]


@pytest.mark.parametrize("m", [1, 4, 7, 16])
@pytest.mark.parametrize("group", [32, 64, 256])
def test_int4_gemv_kernel_matches_the_reference(m, group):
    """Every row from one program's tile (up to 16 rows; 7: rows masked off the tile)."""
    device = "cuda" if CUDA else "cpu"
    n, k = 40, 512  # N not a multiple of BLOCK_N
    values, qweight, scales, zeros = _int4_weights(n, k, group, torch.float16, device, seed=group)
    x = torch.randn(m, k, device=device).to(torch.float16)
    want = F.linear(x.float(), qg.dequantize_int4(qweight, scales, zeros))
    got = qv.int4_gemv(x, qweight, scales, zeros)
    assert got.dtype == torch.float16 and got.shape == (m, n)
    assert _rel(got, want) < TOL[torch.float16]


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(
    ("group", "k", "sub", "nc"), [(32, 512, 32, 1), (128, 640, 128, 4), (384, 768, 128, 2)]
)
def test_int4_gemv_chunks_cover_groups_and_a_partial_last_iteration(m, group, k, sub, nc):
    """``NC`` chunks an iteration (K 640 at 4 x 128: a partial last one; group 384: chunks of
    128 share one scale)."""
    device = "cuda" if CUDA else "cpu"
    _, qweight, scales, zeros = _int4_weights(24, k, group, torch.float16, device, seed=k + m)
    x = torch.randn(m, k, device=device).to(torch.float16)
    want = F.linear(x.float(), qg.dequantize_int4(qweight, scales, zeros))
    cfg = {"BLOCK_M": qv.block_m(m), "BLOCK_N": 8, "SUB": sub, "NC": nc, "num_stages": 2}
    assert _rel(qv.int4_gemv(x, qweight, scales, zeros, cfg=cfg), want) < TOL[torch.float16]


def test_gemv_configs_keep_the_tiles_in_registers_and_refuse_too_few_rows():
    for m in (1, 4, 16):
        c = qv.int4_gemv_config(m, 4096, 4096, 128)
        # partial sums per program: at most 8,192 (the fastest measured at 4 rows), 4,096 above
        partial = c["BLOCK_M"] * c["BLOCK_N"] * c["NC"] * c["SUB"] // 8
        assert c["BLOCK_M"] >= m and partial <= (8192 if m <= 4 else 4096)
        assert 128 % c["SUB"] == 0 and c["SUB"] * c["NC"] <= 1024
        f = qv.gemv_config(m, 4096, 4096, 256)
        assert f["BLOCK_M"] >= m and f["BLOCK_M"] * f["BLOCK_N"] * f["BLOCK_K"] <= 8192
    assert qv.int4_sub(384) == 128 and qv.int4_sub(96) == 32
    x = torch.zeros(3, 64, dtype=torch.float16)
    _, qweight, scales, zeros = _int4_weights(8, 64, 32, torch.float16, "cpu")
    with pytest.raises(ValueError, match="BLOCK_M 2"):
        qv.int4_gemv(x, qweight, scales, zeros, cfg={"BLOCK_M": 2})
    with pytest.raises(ValueError, match="SUB 64"):
        qv.int4_gemv(x, qweight, scales, zeros, cfg={"SUB": 64})


@pytest.mark.parametrize("group", [32, 128, 384])
def test_int4_dequant_kernel_writes_the_dense_weight(group):
    """Prefill rows: the weight dequantised in one pass (K 384: a partial last K tile)."""
    device = "cuda" if CUDA else "cpu"
    _, qweight, scales, zeros = _int4_weights(40, 384, group, torch.float16, device, seed=group)
    got = qg.int4_dequant(qweight, scales, zeros, torch.float16)
    want = qg.dequantize_int4(qweight, scales, zeros, dtype=torch.float32)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("k", [200, 2100])
def test_per_token_quantisation_kernel_matches_the_torch_path(k):
    """One kernel for the scales and the e4m3 values (K over one 1024 block, a partial last)."""
    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(3, k, generator=g) * torch.tensor([[0.01], [1.0], [30.0]])).to(device)
    x[2] = 0.0  # an all-zero row: the scale's floor
    q, scale = qg.quantize_per_token(x.to(torch.bfloat16))
    want_q, want_scale = qg.quantize_activations(x.to(torch.bfloat16), "token")
    assert q.dtype == qg.FP8_DTYPE and scale.shape == (3, 1)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    if not CUDA:  # the interpreter's fp32 -> e4m3 cast mis-rounds (124 -> 64): values on GPUs
        return
    assert (q.float() != want_q.float()).float().mean() < 1e-3  # ties may round either way
    torch.testing.assert_close(q.float(), want_q.float(), rtol=0.07, atol=0)


@pytest.mark.parametrize(
    ("m", "k", "block_k"), [(1, 256, None), (3, 200, 128), (2, 96, 32), (16, 256, None)]
)
def test_fp8_gemv_kernel_is_the_weight_only_product(m, k, block_k):
    """Decode rows: the FP8 weight dequantised in registers times unquantised activations (per
    row scales, or blocks with a partial last one): the exact weight, no activation rounding."""
    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(k)
    n = 40
    kb = 1 if block_k is None else -(-k // block_k)
    w8 = (torch.randn(n, k, generator=g) * 50).to(qg.FP8_DTYPE).to(device)
    scale = (torch.rand(n, kb, generator=g) * 1e-3 + 1e-4).to(device)
    x = torch.randn(m, k, generator=g).to(torch.float16).to(device)
    want = F.linear(x.float(), qg.dequantize_fp8(w8, scale, block_k=block_k))
    got = qv.fp8_gemv(x, w8, scale, block_k)
    assert got.dtype == torch.float16 and got.shape == (m, n)
    assert _rel(got, want) < TOL[torch.float16]


@pytest.mark.parametrize(("m", "n", "k"), [(1, 72, 200), (5, 130, 384), (20, 64, 128)])
def test_fp8_block_kernel_matches_the_reference(m, n, k):
    """Partial last blocks (K 200), N not a multiple of BLOCK_N, rows over one BLOCK_M."""
    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(m * n)
    kb = -(-k // 128)
    w8 = (torch.randn(n, k, generator=g) * 50).to(qg.FP8_DTYPE).to(device)
    scale = (torch.rand(n, kb, generator=g) * 1e-3 + 1e-4).to(device)
    x = torch.randn(m, k, generator=g).to(device)
    q, a_scale = qg.quantize_activations(x, "block", 128)
    got = qg.fp8_block_gemm(q, a_scale, w8, scale, 128, torch.float32)
    want = qg.fp8_linear_reference(x, w8, scale, "block", 128, None)
    # the same products in fp32, another order; Hopper's FP8 tensor cores accumulate with
    # fewer bits than fp32 inside each 128-wide block
    assert _rel(got, want) < (3e-3 if CUDA else 1e-5)


def test_int4_config_splits_k_for_few_rows_only():
    few = qg.int4_config(1, 4096, 4096, 128)
    assert few["SPLIT_K"] > 1 and 4096 % (few["BLOCK_K"] * few["SPLIT_K"]) == 0
    assert qg.int4_config(256, 4096, 4096, 128)["SPLIT_K"] == 1
    assert qg.int4_config(1, 4096, 4096, 32)["BLOCK_K"] == 32
    assert qg.int4_config(64, 4096, 4096, 128)["BLOCK_K"] == 128


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 5, 16, 64, 257, 300])
@pytest.mark.parametrize(
    ("n", "k", "group"), [(4096, 4096, 128), (1536, 4096, 32), (4096, 14336, 14336)]
)
def test_gpu_int4_kernel(dtype, m, n, k, group):
    _, qweight, scales, zeros = _int4_weights(n, k, group, dtype, "cuda", seed=m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    want = F.linear(x.float(), qg.dequantize_int4(qweight, scales, zeros))
    got = qg.int4_linear(x, qweight, scales, zeros)
    assert got.dtype == dtype
    assert _rel(got, want) < TOL[dtype]


@pytest.mark.gpu
def test_gpu_int4_act_order_gathers_the_activations():
    n, k, group = 256, 512, 64
    _, qweight, scales, zeros = _int4_weights(n, k, group, torch.bfloat16, "cuda")
    perm = torch.randperm(k, device="cuda")
    x = torch.randn(3, k, device="cuda").to(torch.bfloat16)
    want = F.linear(x.float(), qg.dequantize_int4(qweight, scales, zeros, perm))
    assert _rel(qg.int4_linear(x, qweight, scales, zeros, perm), want) < TOL[torch.bfloat16]


def _fp8_want(x, w8, scale, mode, block_k, input_scale):
    """Up to ``GEMV_ROWS`` rows the GEMV kernel leaves the activations unquantised."""
    if x.shape[0] <= qg.GEMV_ROWS:
        return F.linear(x.float(), qg.dequantize_fp8(w8, scale, block_k=block_k))
    return qg.fp8_linear_reference(x, w8, scale, mode, block_k, input_scale)


def _fp8_weights(n, k, kb, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w8 = (torch.randn(n, k, device="cuda", generator=g) * 50).to(qg.FP8_DTYPE)
    scale = torch.rand(n, kb, device="cuda", generator=g) * 1e-3 + 1e-4
    return w8, scale


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["token", "static"])
@pytest.mark.parametrize("m", [1, 7, 64, 513])
def test_gpu_fp8_scaled_mm_per_channel(mode, m):
    n, k = 1536, 4096
    w8, scale = _fp8_weights(n, k, 1, seed=m)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    input_scale = torch.tensor([4.0 / 448], device="cuda")
    want = _fp8_want(x, w8, scale, mode, None, input_scale)
    got = qg.fp8_linear(x, w8, scale, mode, None, input_scale)
    assert got.dtype == torch.bfloat16
    assert _rel(got, want) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16, 100, 600])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (576, 1000), (2048, 7168)])
def test_gpu_fp8_block_kernel(m, n, k):
    kb = -(-k // 128)
    w8, scale = _fp8_weights(n, k, kb, seed=m)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    want = _fp8_want(x, w8, scale, "block", 128, None)
    got = qg.fp8_linear(x, w8, scale, "block", 128, None)
    assert _rel(got, want) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_kernels_replay_in_a_cuda_graph():
    _, qweight, scales, zeros = _int4_weights(1024, 1024, 128, torch.bfloat16, "cuda")
    w8, scale = _fp8_weights(1024, 1024, 8)
    x = torch.randn(2, 1024, device="cuda").to(torch.bfloat16)

    def step():
        return qg.int4_linear(x, qweight, scales, zeros), qg.fp8_linear(x, w8, scale, "block", 128)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    fresh = step()
    assert all(torch.equal(a, b) for a, b in zip(out, fresh, strict=True))
    assert not torch.equal(eager[0], fresh[0])
