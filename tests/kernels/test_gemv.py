"""Weight-streaming GEMV kernels (Triton; interpreted without CUDA) against torch references:
``F.linear``, silu*mul then ``F.linear``, RMSNorm then ``F.linear``, on fresh random inputs.

Tolerances (``assert_close``'s atol = rtol, outputs of order 1): fp32 2e-5, fp16 2e-3, bf16 2e-2.
The kernels sum in fp32 in another order than torch and round the output once (bias included);
a residual is added after that rounding and rounded again, as ``(x @ w.T + b).to(dtype) + r``;
the fused activations are rounded to the dtype before the dot, as the unfused path rounds them,
so the only differences left are the sum's order and an occasional one-ulp flip of an
activation (a different ``exp`` or ``rsqrt``), well inside these bounds.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is first wrapped

from radixlm.kernels import gemv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
EXTRAS = ["plain", "bias", "residual", "bias+residual"]


def ref_rmsnorm(x, w, eps):
    """The RMSNorm reference of test_fused.py (normalised value rounded before the weight)."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _inputs(m, n, k, dtype, seed, width=None):
    """``x`` ``[m, width or k]``, ``w`` ``[n, k]`` scaled so ``x @ w.T`` is of order 1, and a
    residual ``[m, n]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, width or k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    res = torch.randn(m, n, generator=g).to(DEVICE, dtype)
    return x, w, res, g


def _assert_close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("extra", EXTRAS)
def test_gemv_matches_linear(dtype, m, extra):
    n, k = 72, 192  # N not a multiple of any BLOCK_N but 4 and 8; K of 1.5 default BLOCK_Ks
    x, w, res, g = _inputs(m, n, k, dtype, seed=m * 10 + EXTRAS.index(extra))
    bias = torch.randn(n, generator=g).to(DEVICE, dtype) if "bias" in extra else None
    residual = res if "residual" in extra else None
    want = F.linear(x, w, bias)
    if residual is not None:
        want = want + residual
    _assert_close(gemv.gemv(x, w, bias, residual=residual), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (4, 48, 64), (3, 50, 128)])
def test_gemv_strided_rows(dtype, m, n, k):
    """``x`` and the residual as row slices of wider buffers (a row stride beyond K / N)."""
    wide, w, _, g = _inputs(m, n, k, dtype, seed=n, width=k + 32)
    res_wide = torch.randn(m, n + 8, generator=g).to(DEVICE, dtype)
    x, res = wide[:, 16 : 16 + k], res_wide[:, :n]
    _assert_close(gemv.gemv(x, w, residual=res), F.linear(x, w) + res, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_silu_mul(dtype, m, with_residual):
    n, k = 64, 160
    gu, w, res, _ = _inputs(m, n, k, dtype, seed=m + 100 * with_residual, width=2 * k)
    act = (F.silu(gu[:, :k].float()) * gu[:, k:].float()).to(dtype)  # fused.silu_and_mul's
    want = F.linear(act, w)
    residual = res if with_residual else None
    if residual is not None:
        want = want + residual
    _assert_close(gemv.gemv_silu_mul(gu, w, residual=residual), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (2, 48, 64), (4, 80, 112)])
def test_gemv_rmsnorm(dtype, m, n, k):
    x, w, _, g = _inputs(m, n, k, dtype, seed=k + m)
    x = x * 3 + 0.5  # rms away from 1, so the normalisation matters
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    want = F.linear(ref_rmsnorm(x, norm_w, 1e-5), w)
    _assert_close(gemv.gemv_rmsnorm(x, norm_w, 1e-5, w), want, dtype)


CFGS = [
    {"BLOCK_N": 4, "BLOCK_K": 64, "num_stages": 1},
    {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1},
    {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 1, "BLOCK_K": 256},
]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_result_does_not_depend_on_cfg(cfg):
    """fp32, K = 208 (uneven for every BLOCK_K but 16): only the summation order changes."""
    m, n, k = 3, 40, 208
    x, w, res, g = _inputs(m, n, k, torch.float32, seed=5)
    gu = torch.randn(m, 2 * k, generator=g).to(DEVICE)
    norm_w = torch.rand(k, generator=g).add(0.5).to(DEVICE)
    tight = {"atol": 2e-6, "rtol": 2e-6}
    torch.testing.assert_close(
        gemv.gemv(x, w, residual=res, cfg=cfg), gemv.gemv(x, w, residual=res), **tight
    )
    torch.testing.assert_close(
        gemv.gemv_silu_mul(gu, w, cfg=cfg), gemv.gemv_silu_mul(gu, w), **tight
    )
    torch.testing.assert_close(
        gemv.gemv_rmsnorm(x, norm_w, 1e-6, w, cfg=cfg),
        gemv.gemv_rmsnorm(x, norm_w, 1e-6, w),
        **tight,
    )


def test_supported_refusals():
    w = torch.randn(32, 64, device=DEVICE)
    assert gemv.supported(torch.randn(4, 64, device=DEVICE), w)
    refused = {
        "too many rows": (torch.randn(gemv.MAX_ROWS + 1, 64, device=DEVICE), w),
        "no rows": (torch.randn(0, 64, device=DEVICE), w),
        "dtype mismatch": (torch.randn(1, 64, device=DEVICE, dtype=torch.float16), w),
        "integer dtype": (torch.ones(1, 64, device=DEVICE, dtype=torch.int32), w.int()),
        "w not contiguous": (torch.randn(1, 64, device=DEVICE), torch.randn(64, 32).t()),
        "K not a multiple of 16": (torch.randn(1, 40, device=DEVICE), w[:, :40].contiguous()),
        "1-D x": (torch.randn(64, device=DEVICE), w),
        "x's last dim strided": (torch.randn(64, 2, device=DEVICE).t(), w),
    }
    for why, (x, ww) in refused.items():
        assert not gemv.supported(x, ww.to(DEVICE)), why
    with pytest.raises(ValueError, match="1 to 4 rows"):
        gemv.gemv(torch.randn(5, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="share a float dtype"):
        gemv.gemv(torch.randn(1, 64, device=DEVICE, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.gemv(torch.randn(1, 64, device=DEVICE), torch.randn(64, 32, device=DEVICE).t())


def test_bad_shapes_are_rejected():
    x = torch.randn(2, 64, device=DEVICE)
    w = torch.randn(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match="gu has 64 columns, expected 128"):
        gemv.gemv_silu_mul(x, w)
    with pytest.raises(ValueError, match="x has 64 columns, expected 32"):
        gemv.gemv(x, w[:, :32].contiguous())
    with pytest.raises(ValueError, match="residual must be"):
        gemv.gemv(x, w, residual=torch.randn(2, 31, device=DEVICE))
    with pytest.raises(ValueError, match="bias must be"):
        gemv.gemv(x, w, torch.randn(31, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight must be"):
        gemv.gemv_rmsnorm(x, torch.ones(32, device=DEVICE), 1e-5, w)


def test_not_supported_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not gemv.supported(torch.randn(1, 64), torch.randn(32, 64))


@pytest.mark.parametrize(
    "n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
)
def test_config_for_the_8b_shapes(n, k):
    """A tile per program, enough programs for 132 SMs without splitting K, and a BLOCK_K
    that divides K (no masked weight loads)."""
    for m in range(1, gemv.MAX_ROWS + 1):
        c = gemv.config(m, n, k)
        assert set(c) == {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
        assert -(-n // c["BLOCK_N"]) >= 2 * 132
        assert k % c["BLOCK_K"] == 0 and c["BLOCK_K"] >= 64
        assert c["BLOCK_N"] * c["BLOCK_K"] * m <= 8192  # the fp32 accumulators' registers


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="8B-sized weights need a CUDA device")
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (6144, 4096)])
def test_8b_shapes_in_bf16(n, k):
    for m in (1, 4):
        x, w, res, g = _inputs(m, n, k, torch.bfloat16, seed=n + m)
        _assert_close(gemv.gemv(x, w, residual=res), F.linear(x, w) + res, torch.bfloat16)
        norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, torch.bfloat16)
        want = F.linear(ref_rmsnorm(x, norm_w, 1e-5), w)
        _assert_close(gemv.gemv_rmsnorm(x, norm_w, 1e-5, w), want, torch.bfloat16)
        gu = torch.randn(m, 2 * k, generator=g).to(DEVICE, torch.bfloat16)
        act = (F.silu(gu[:, :k].float()) * gu[:, k:].float()).to(torch.bfloat16)
        _assert_close(gemv.gemv_silu_mul(gu, w), F.linear(act, w), torch.bfloat16)
