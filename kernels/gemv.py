"""Weight-streaming GEMV for decode (Triton): ``y = x @ W.T`` for a few rows of ``x``.

At batch 1 a decode step of an 8B model is bound by reading its weights once; cuBLAS reads them
close to the copy rate, and what is left to win is the small kernels around each projection
(RMSNorm before QKV and gate/up, silu*mul before down, the residual adds). These kernels stream
``W`` (``[N, K]``, row-major like ``nn.Linear.weight``) once for all ``M <= MAX_ROWS`` rows of
``x`` and fold that work into the same pass:

- ``gemv(x, w, bias, residual=...)``: ``x @ w.T (+ bias) (+ residual)``;
- ``gemv_silu_mul(gu, w, residual=...)``: ``silu(gate) * up`` computed from the merged gate/up
  output while streaming the down projection (no intermediate tensor);
- ``gemv_rmsnorm(x, norm_weight, eps, w)``: ``rmsnorm(x) @ w.T``.

Design: one program per ``BLOCK_N`` output rows and no split-K. Each program walks ``K`` in
``BLOCK_K`` chunks: it loads a ``[BLOCK_N, BLOCK_K]`` tile of ``W`` (16-byte vector loads: ``K``
is a multiple of 16, so every row starts aligned), rebuilds the activation chunk of each row of
``x`` and accumulates ``w * x`` element-wise into one fp32 ``[BLOCK_N, BLOCK_K]`` accumulator per
row; the cross-thread reduction over ``K`` happens once, after the loop. Loads are software
pipelined ``num_stages`` deep (the loop has no ``tl.dot``, so the stage count is set on the loop
itself). With ``BLOCK_N <= 8`` the smallest projection (``N = 4096``) still has 512 programs,
about four per SM of a 132-SM H100/H200, so there is no need to split ``K``.

Rounding, chosen to match the unfused torch path within one rounding step:

- the sum is fp32; ``bias`` is added to it before the one rounding to the activation dtype (as
  ``addmm``); ``residual`` is added after that rounding, in fp32, and rounded again:
  ``(x @ w.T + bias).to(dtype) + residual`` as torch computes it;
- ``gemv_silu_mul`` rounds ``silu(gate) * up`` (computed in fp32) to the dtype once before the
  dot, as ``fused.silu_and_mul`` does;
- ``gemv_rmsnorm`` rounds ``x * rsqrt(mean(x^2) + eps)`` to the dtype, multiplies by
  ``norm_weight`` and rounds again, as ``fused.rmsnorm`` does.

The launch parameters come from :func:`config` (a heuristic, deterministic, so that a CUDA graph
captures the same kernel every time); each function takes ``cfg=`` to override them. They run on
CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None
    tl = None

MAX_ROWS = 4
"""The most rows of ``x`` one launch serves (one fp32 accumulator tile per row)."""

ENABLED = os.environ.get("RADIXLM_GEMV", "1") != "0"
"""Whether the models take the weight-streaming decoder layer for small GPU batches (on by
default: the 8B shape's batch-1 step on an H100 6.20 -> 5.76 ms, docs/results/gpu-decode.md);
``RADIXLM_GEMV=0`` turns it off."""

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PLAIN, _SILU_MUL, _RMSNORM = 0, 1, 2


def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    bias_ptr,
    res_ptr,
    nw_ptr,
    N,
    K,
    stride_x,
    stride_y,
    stride_res,
    eps,
    M: tl.constexpr,
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
):
    """Program ``i`` writes columns ``[i * BLOCK_N, (i + 1) * BLOCK_N)`` of all ``M`` rows of
    ``y``. ``MODE``: 0 reads ``x`` as is, 1 reads ``silu(x[:, :K]) * x[:, K:]``, 2 reads
    ``nw * rmsnorm(x)``. The tile's rows past ``N`` re-read row ``N - 1`` (no mask on the
    weight loads) and are not stored. ``NORM_BLOCK`` (mode 2): the chunk of a row summed per
    step of the 1 / rms pass, the whole row where it fits, so that pass costs one round trip
    to L2 before the weights start streaming."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K
    dt = y_ptr.dtype.element_ty

    # rmsnorm: each row's 1 / rms over the whole row first (it is small and stays in L2)
    inv0 = 1.0
    inv1 = 1.0
    inv2 = 1.0
    inv3 = 1.0
    if MODE == 2:
        sq0 = tl.zeros([NORM_BLOCK], tl.float32)
        sq1 = tl.zeros([NORM_BLOCK], tl.float32)
        sq2 = tl.zeros([NORM_BLOCK], tl.float32)
        sq3 = tl.zeros([NORM_BLOCK], tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            kk = k0 + tl.arange(0, NORM_BLOCK)
            for m in tl.static_range(M):
                v = tl.load(x_ptr + m * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)
                if m == 0:
                    sq0 += v * v
                elif m == 1:
                    sq1 += v * v
                elif m == 2:
                    sq2 += v * v
                else:
                    sq3 += v * v
        inv0 = 1.0 / tl.sqrt(tl.sum(sq0, 0) / K + eps)
        inv1 = 1.0 / tl.sqrt(tl.sum(sq1, 0) / K + eps)
        inv2 = 1.0 / tl.sqrt(tl.sum(sq2, 0) / K + eps)
        inv3 = 1.0 / tl.sqrt(tl.sum(sq3, 0) / K + eps)

    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + rk
        kmask = kk < K
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :]).to(tl.float32)
        else:
            w = tl.load(w_rows + kk[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
        if MODE == 2:
            nw = tl.load(nw_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        for m in tl.static_range(M):
            xr = x_ptr + m * stride_x
            if MODE == 1:
                gate = tl.load(xr + kk, mask=kmask, other=0.0).to(tl.float32)
                up = tl.load(xr + K + kk, mask=kmask, other=0.0).to(tl.float32)
                a = (gate / (1.0 + tl.exp(-gate)) * up).to(dt).to(tl.float32)
            else:
                a = tl.load(xr + kk, mask=kmask, other=0.0).to(tl.float32)
                if MODE == 2:
                    inv = inv0 if m == 0 else (inv1 if m == 1 else (inv2 if m == 2 else inv3))
                    a = ((a * inv).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
            if m == 0:
                acc0 += w * a[None, :]
            elif m == 1:
                acc1 += w * a[None, :]
            elif m == 2:
                acc2 += w * a[None, :]
            else:
                acc3 += w * a[None, :]

    nmask = rn < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    for m in tl.static_range(M):
        acc = acc0 if m == 0 else (acc1 if m == 1 else (acc2 if m == 2 else acc3))
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += bias
        y = y.to(dt)
        if HAS_RES:
            r = tl.load(res_ptr + m * stride_res + rn, mask=nmask, other=0.0).to(tl.float32)
            y = (y.to(tl.float32) + r).to(dt)
        tl.store(y_ptr + m * stride_y + rn, y, mask=nmask)


@functools.cache
def _jit():
    """Wraps the kernel on first use, so ``TRITON_INTERPRET`` is read then, not at import."""
    return triton.jit(_gemv_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _refusal(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the kernels cannot serve ``x`` against ``w``, or None when they can."""
    if triton is None:
        return "triton is not installed"
    if not (x.is_cuda or _interpreting()):
        return "x must be a CUDA tensor (or TRITON_INTERPRET=1)"
    if x.dim() != 2 or w.dim() != 2:
        return f"x and w must be 2-D, got {x.dim()}-D and {w.dim()}-D"
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return f"x must have 1 to {MAX_ROWS} rows, got {x.shape[0]}"
    if x.dtype != w.dtype or x.dtype not in _DTYPES:
        return f"x and w must share a float dtype (bf16, fp16, fp32), got {x.dtype}, {w.dtype}"
    if x.device != w.device:
        return f"x and w are on different devices ({x.device}, {w.device})"
    if w.shape[1] % 16 or not w.shape[0]:
        return f"w must be [N >= 1, K] with K a multiple of 16, got {tuple(w.shape)}"
    if not w.is_contiguous():
        return "w must be contiguous (row-major [N, K])"
    if x.stride(1) != 1:
        return "x must have a contiguous last dim"
    return None


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernels serve ``x`` ``[M, *]`` against ``w`` ``[N, K]``: Triton installed, a
    CUDA ``x`` (any device under ``TRITON_INTERPRET=1``), both 2-D, ``1 <= M <= MAX_ROWS``, one
    float dtype, ``K`` a multiple of 16, ``w`` contiguous and ``x``'s last dim contiguous. The
    width of ``x`` (``K``, or ``2K`` for :func:`gemv_silu_mul`) is checked by each function."""
    return _refusal(x, w) is None


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def config(m: int, n: int, k: int) -> dict:
    """Launch parameters for ``m`` rows against a ``[n, k]`` weight: ``BLOCK_N``, ``BLOCK_K``,
    ``num_warps``, ``num_stages``.

    ``BLOCK_N`` is the largest of 16, 8, 4 that leaves at least 512 programs (about four per SM
    of 132, so the last wave is short), then capped by ``n``. A ``W`` tile holds 4096 elements
    (8 KiB of bf16; 2048 from three rows on, since each row keeps a tile-sized fp32 accumulator
    in registers), so ``BLOCK_K = 4096 // BLOCK_N``, capped by ``k``. Four warps; three stages
    keep two tiles in flight per program beside the one being summed."""
    block_n = next((b for b in (16, 8) if -(-n // b) >= 512), 4)
    block_n = min(block_n, _pow2_at_least(n))
    tile = 4096 if m <= 2 else 2048
    block_k = min(max(tile // block_n, 16), _pow2_at_least(max(k, 16)))
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3}


def _check_width(x: torch.Tensor, w: torch.Tensor, width: int, name: str) -> None:
    reason = _refusal(x, w)
    if reason is not None:
        raise ValueError(reason)
    if x.shape[1] != width:
        raise ValueError(
            f"{name} has {x.shape[1]} columns, expected {width} for w {tuple(w.shape)}"
        )


def _check_vector(t: torch.Tensor | None, length: int, x: torch.Tensor, name: str) -> None:
    if t is not None and (t.shape != (length,) or not t.is_contiguous() or t.device != x.device):
        raise ValueError(f"{name} must be a contiguous [{length}] tensor on {x.device}")


def _launch(x, w, mode, bias=None, residual=None, norm_weight=None, eps=0.0, cfg=None):
    m, (n, k) = x.shape[0], w.shape
    y = x.new_empty(m, n)
    if residual is not None:
        if residual.shape != (m, n) or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(
                f"residual must be [{m}, {n}] {x.dtype} with a contiguous last dim, got "
                f"{tuple(residual.shape)} {residual.dtype}"
            )
    c = {**config(m, n, k), **(cfg or {})}
    block_n, block_k = c["BLOCK_N"], c["BLOCK_K"]
    _jit()[(triton.cdiv(n, block_n),)](
        x,
        w,
        y,
        bias if bias is not None else y,
        residual if residual is not None else y,
        norm_weight if norm_weight is not None else y,
        n,
        k,
        x.stride(0),
        y.stride(0),
        residual.stride(0) if residual is not None else 0,
        float(eps),
        M=m,
        MODE=mode,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=c["num_stages"],
        NORM_BLOCK=min(_pow2_at_least(k), 4096) if mode == _RMSNORM else 16,
        num_warps=c["num_warps"],
        num_stages=c["num_stages"],
    )
    return y


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    cfg: dict | None = None,
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` (``x`` ``[M, K]``, ``w`` ``[N, K]``) plus ``residual``
    ``[M, N]`` when given, in ``x``'s dtype; ``cfg`` overrides :func:`config`'s keys."""
    _check_width(x, w, w.shape[1], "x")
    _check_vector(bias, w.shape[0], x, "bias")
    return _launch(x, w, _PLAIN, bias=bias, residual=residual, cfg=cfg)


def gemv_silu_mul(
    gu: torch.Tensor,
    w: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    cfg: dict | None = None,
) -> torch.Tensor:
    """``silu(gu[:, :K]) * gu[:, K:]`` (rounded to the dtype) times ``w.T`` for ``gu``
    ``[M, 2K]`` (the merged gate/up output) and the down projection ``w`` ``[N, K]``, plus
    ``residual`` when given; the product of gate and up is never written to memory."""
    _check_width(gu, w, 2 * w.shape[1], "gu")
    return _launch(gu, w, _SILU_MUL, residual=residual, cfg=cfg)


def gemv_rmsnorm(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    *,
    cfg: dict | None = None,
) -> torch.Tensor:
    """``rmsnorm(x) @ w.T`` with ``rmsnorm(x) = norm_weight * (x32 * rsqrt(mean(x32^2) + eps))``
    (the normalised value rounded to the dtype before the weight multiply, the product rounded
    again), for ``x`` ``[M, K]`` and ``norm_weight`` ``[K]``; each program recomputes its rows'
    1 / rms before streaming its block of ``w``."""
    _check_width(x, w, w.shape[1], "x")
    _check_vector(norm_weight, w.shape[1], x, "norm_weight")
    return _launch(x, w, _RMSNORM, norm_weight=norm_weight, eps=eps, cfg=cfg)
