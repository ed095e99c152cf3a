"""Decode-row GEMVs of the quantised linear layers (Triton): up to ``quant_gemm.GEMV_ROWS`` rows
of unquantised activations times FP8 or int4 weights dequantised in registers, for
``kernels/quant_gemm.py``'s dispatch (its docstring gives the weight layouts).

The loops over ``K`` are software-pipelined ``num_stages`` deep (``tl.range``: no ``tl.dot`` in
the loop, so the stage count is set on the loop itself, as in ``kernels/gemv.py``). Launch
parameters come from :func:`gemv_config` (deterministic, for CUDA graphs); each function takes
``cfg=`` to override them (``srt/bench/tune_quant.py`` sweeps them). They run on CUDA tensors,
and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None
    tl = None

# --- Triton: decode rows (GEMV), FP8 and int4 weights times unquantised activations --------
# Up to GEMV_ROWS rows one program computes BLOCK_N outputs of one row, reading its weight rows
# once with no tensor-core tile to fill (a 16-row tl.dot tile for one row wastes 15/16 of it
# and needs split K to spread over the SMs). The programs of one weight tile are adjacent in
# the launch order (rows vary fastest), so a second row's read of the tile hits L2.


def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """``y[m, n-tile] = sum_k x[m, k] w8[n, k] s[n, k // SCALE_K]`` in fp32 (``SCALE_K``: the
    scales' block width, a multiple of ``BLOCK_K``; 0: one scale per row)."""
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(x_ptr + m * stride_xm + k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        if SCALE_K == 0:
            acc += w * x[None, :]
        else:
            s = tl.load(s_ptr + offs_n * stride_sn + k0 // SCALE_K, mask=mask_n, other=0.0)
            acc += w * x[None, :] * s[:, None]
    y = tl.sum(acc, axis=1)
    if SCALE_K == 0:
        y = y * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    K,
    GROUP,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ym,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """``y[m, n-tile] = x[m] @ dequant(q)[n-tile]^T``: each row's ``BLOCK_K / 8`` words of a
    tile are loaded once (contiguous), and nibble ``i`` of them multiplies the features
    ``8 c + i`` (a strided read of the activations, which stay in L1). The scale and zero of
    word ``c`` are its group's (``GROUP`` a multiple of 8): gathered per word, so that a tile can
    span several groups and each iteration reads enough bytes to keep the memory busy."""
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_K // 8)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        words = tl.load(
            q_ptr + offs_n[:, None] * stride_qn + (k0 // 8 + offs_c)[None, :],
            mask=mask_n[:, None],
            other=0,
        )
        g = offs_n[:, None] * stride_sn + ((k0 + 8 * offs_c) // GROUP)[None, :]
        s = tl.load(s_ptr + g, mask=mask_n[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g, mask=mask_n[:, None], other=0.0).to(tl.float32)
        for i in tl.static_range(8):
            x = tl.load(x_ptr + m * stride_xm + k0 + offs_c * 8 + i).to(tl.float32)
            q = ((words >> (4 * i)) & 0xF).to(tl.float32)
            acc += (q - z) * s * x[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def _int4_gemv_grouped_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ym,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """:func:`_int4_gemv_kernel` with the scale and zero factored out of each group:
    ``sum_k (q - z) s x = s (sum_k q x - z sum_k x)`` over the ``GROUP`` features of a group, so
    the inner loop is one multiply-add per weight and the scales are loaded once per row and
    group (not per word). ``NG`` groups per iteration, held as a ``[BLOCK_N, NG, GROUP / 8]``
    tile of words."""
    W: tl.constexpr = GROUP // 8
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_g = tl.arange(0, NG)
    word = offs_g[:, None] * W + tl.arange(0, W)[None, :]  # [NG, W]: words of the iteration
    rows = offs_n[:, None, None] * stride_qn
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    for k0 in tl.range(0, K, GROUP * NG, num_stages=NUM_STAGES):
        words = tl.load(q_ptr + rows + (k0 // 8 + word)[None, :, :], mask=mask_n[:, None, None])
        part = tl.zeros((BLOCK_N, NG, W), dtype=tl.float32)
        xsum = tl.zeros((NG, W), dtype=tl.float32)
        for i in tl.static_range(8):
            x = tl.load(x_ptr + m * stride_xm + k0 + word * 8 + i).to(tl.float32)
            part += ((words >> (4 * i)) & 0xF).to(tl.float32) * x[None, :, :]
            xsum += x
        g = offs_n[:, None] * stride_sn + (k0 // GROUP + offs_g)[None, :]
        s = tl.load(s_ptr + g, mask=mask_n[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g, mask=mask_n[:, None], other=0.0).to(tl.float32)
        acc += s * (tl.sum(part, axis=2) - z * tl.sum(xsum, axis=1)[None, :])
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


@functools.cache
def _jit_gemv(name: str):
    kernels = {
        "fp8": _fp8_gemv_kernel,
        "int4": _int4_gemv_kernel,
        "int4_grouped": _int4_gemv_grouped_kernel,
    }
    return triton.jit(kernels[name])


def int4_grouped_fits(k: int, group: int, ng: int = 1) -> bool:
    """Whether :func:`_int4_gemv_grouped_kernel` serves this shape: ``GROUP / 8`` and ``NG``
    powers of two, ``K`` a whole number of iterations."""
    w = group // 8
    return (
        group % 8 == 0 and w > 0 and not w & (w - 1) and not ng & (ng - 1) and k % (group * ng) == 0
    )


def gemv_config(m: int, n: int, k: int, block_k_max: int) -> dict:
    """Launch parameters of the GEMV kernels (deterministic): 16 output rows per program, 8
    where that leaves fewer than 512 programs, and ``K`` tiles of ``block_k_max`` (int4: up to
    1024 features, 4 KiB of a 16-row tile per iteration; FP8: 256, or the scales' block)."""
    block_n = 16 if m * -(-n // 16) >= 512 else 8
    return {"BLOCK_N": block_n, "BLOCK_K": block_k_max, "num_warps": 4, "num_stages": 3}


def fp8_gemv(x2, w8, w_scale, block_k: int | None, cfg=None) -> torch.Tensor:
    """``x2`` ``[M, K]`` (``M <= GEMV_ROWS``, unquantised) times the FP8 weight dequantised in
    registers -> ``[M, N]`` ``x2.dtype``. ``block_k``: the scales' block width (a power of two
    >= 16), None for one scale per row."""
    x2 = x2.contiguous()
    m, k = x2.shape
    n = w8.shape[0]
    bk = 256 if block_k is None else min(block_k, 128)
    conf = {**gemv_config(m, n, k, bk), **(cfg or {})}
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    grid = (m, triton.cdiv(n, conf["BLOCK_N"]))
    _jit_gemv("fp8")[grid](
        x2,
        w8,
        w_scale,
        y,
        n,
        k,
        x2.stride(0),
        w8.stride(0),
        w_scale.stride(0),
        y.stride(0),
        SCALE_K=0 if block_k is None else block_k,
        BLOCK_N=conf["BLOCK_N"],
        BLOCK_K=conf["BLOCK_K"],
        NUM_STAGES=conf["num_stages"],
        num_warps=conf["num_warps"],
    )
    return y


def int4_gemv(x2, qweight, scales, zeros, cfg=None) -> torch.Tensor:
    """``x2`` ``[M, K]`` (``M <= GEMV_ROWS``) times the int4 weight transposed -> ``[M, N]``."""
    x2 = x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[0]
    group = k // scales.shape[1]
    bk = next(b for b in (1024, 512, 256, 128, 64, 32) if k % b == 0)
    conf = {**gemv_config(m, n, k, bk), **(cfg or {})}
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    grid = (m, triton.cdiv(n, conf["BLOCK_N"]))
    if conf.get("NG") and int4_grouped_fits(k, group, conf["NG"]):
        _jit_gemv("int4_grouped")[grid](
            x2,
            qweight,
            scales,
            zeros,
            y,
            n,
            k,
            x2.stride(0),
            qweight.stride(0),
            scales.stride(0),
            y.stride(0),
            GROUP=group,
            NG=conf["NG"],
            BLOCK_N=conf["BLOCK_N"],
            NUM_STAGES=conf["num_stages"],
            num_warps=conf["num_warps"],
        )
        return y
    _jit_gemv("int4")[grid](
        x2,
        qweight,
        scales,
        zeros,
        y,
        n,
        k,
        group,
        x2.stride(0),
        qweight.stride(0),
        scales.stride(0),
        y.stride(0),
        BLOCK_N=conf["BLOCK_N"],
        BLOCK_K=conf["BLOCK_K"],
        NUM_STAGES=conf["num_stages"],
        num_warps=conf["num_warps"],
    )
    return y
