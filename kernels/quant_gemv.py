"""Decode-row GEMVs of the quantised linear layers (Triton): up to 16 rows of unquantised
activations times FP8 or int4 weights dequantised in registers, each weight tile read once for
all the rows, for ``kernels/quant_gemm.py``'s dispatch (which uses them up to its
``GEMV_ROWS``; its docstring gives the weight layouts).

The loops over ``K`` are software-pipelined ``num_stages`` deep (``tl.range``: no ``tl.dot`` in
the loop, so the stage count is set on the loop itself, as in ``kernels/gemv.py``). Launch
parameters come from :func:`gemv_config` / :func:`int4_gemv_config` (deterministic, for CUDA graphs); each function takes
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
# One program computes BLOCK_N outputs for every row (BLOCK_M >= M, up to 16): each weight
# tile is read from memory once and multiplied by all the rows in registers (a program per
# row re-read the tile per row, and the rows=4 times were ~4x the rows=1 times). No tensor-core
# tile: the ALU work per weight is a few instructions plus one FMA per row.
#
# int4 unpacking: a nibble becomes a float without an int -> float conversion (I2F runs at a
# quarter of the FMA rate on Hopper and was the GEMV's bottleneck at one row): ``q | 0x4B000000``
# read as fp32 is ``2^23 + q`` exactly, and one subtraction leaves ``q``.

# constexpr globals: a Triton kernel may read no other module-level names
MAGIC = tl.constexpr(0x4B000000) if tl is not None else 0x4B000000  # fp32 bits of 2^23
MAGIC_F = tl.constexpr(8388608.0) if tl is not None else 8388608.0


def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """``y[:M, n-tile] = sum_k x[:M, k] w8[n, k] s[n, k // SCALE_K]`` in fp32 (``SCALE_K``: the
    scales' block width, a multiple of ``BLOCK_K``; 0: one scale per row). The weight tile is
    loaded once per iteration for all ``M`` rows."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        if SCALE_K != 0:
            s = tl.load(s_ptr + offs_n * stride_sn + k0 // SCALE_K, mask=mask_n, other=0.0)
            w = w * s[:, None]
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if SCALE_K == 0:
        y = y * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUP,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,
    NC: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """``y[:M, n-tile] = x[:M] @ dequant(q)[n-tile]^T``. An iteration covers ``NC`` chunks of
    ``SUB`` features (``SUB`` divides the group, so one scale and zero per row and chunk):
    a ``[BLOCK_N, NC, SUB / 8]`` tile of words, each row's words contiguous (wide loads), read
    once for all rows. Nibble ``i`` of word ``c`` is feature ``8 c + i``: the activations are
    read with stride 8 (they stay in L1). The scale and zero are factored out of each chunk,
    ``sum (q - z) s x = s (sum q x - z sum x)``: one FMA per weight and row."""
    CW: tl.constexpr = SUB // 8
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, NC)
    mask_m = offs_m < M
    mask_n = offs_n < N
    word = offs_c[:, None] * CW + tl.arange(0, CW)[None, :]  # [NC, CW]: words of an iteration
    q_rows = q_ptr + offs_n[:, None, None] * stride_qn
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N, NC), dtype=tl.float32)
    for k0 in tl.range(0, K, SUB * NC, num_stages=NUM_STAGES):
        ck = k0 + offs_c * SUB  # first feature of each chunk
        mask_c = ck < K
        words = tl.load(
            q_rows + (k0 // 8 + word)[None, :, :],
            mask=mask_n[:, None, None] & mask_c[None, :, None],
            other=0,
        )  # [BLOCK_N, NC, CW]
        mask_x = mask_m[:, None, None] & mask_c[None, :, None]
        part = tl.zeros((BLOCK_M, BLOCK_N, NC, CW), dtype=tl.float32)
        xsum = tl.zeros((BLOCK_M, NC, CW), dtype=tl.float32)
        for i in tl.static_range(8):
            x = tl.load(x_rows + (k0 + word * 8 + i)[None, :, :], mask=mask_x, other=0.0)
            x = x.to(tl.float32)  # [BLOCK_M, NC, CW]
            q = (((words >> (4 * i)) & 0xF) | MAGIC).to(tl.float32, bitcast=True) - MAGIC_F
            part += q[None, :, :, :] * x[:, None, :, :]
            xsum += x
        g = offs_n[:, None] * stride_sn + (ck // GROUP)[None, :]  # [BLOCK_N, NC]
        mask_g = mask_n[:, None] & mask_c[None, :]
        s = tl.load(s_ptr + g, mask=mask_g, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g, mask=mask_g, other=0.0).to(tl.float32)
        acc += s[None, :, :] * (
            tl.sum(part, axis=3) - z[None, :, :] * tl.sum(xsum, axis=2)[:, None, :]
        )
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@functools.cache
def _jit_gemv(name: str):
    kernels = {"fp8": _fp8_gemv_kernel, "int4": _int4_gemv_kernel}
    return triton.jit(kernels[name])


def block_m(m: int) -> int:
    """The rows of a GEMV program: ``m`` rounded up to a power of two (the kernels' tiles)."""
    return 1 << max(m - 1, 0).bit_length()


def int4_sub(group: int) -> int:
    """Features per chunk of the int4 GEMV: the largest of 128, 64, 32 dividing the group."""
    return next(s for s in (128, 64, 32) if group % s == 0)


def gemv_config(m: int, n: int, k: int, block_k_max: int) -> dict:
    """FP8 GEMV launch parameters (deterministic): ``BLOCK_M`` the rows rounded up to a power of
    two; ``BLOCK_N`` outputs per program with the fp32 accumulator ``BLOCK_M x BLOCK_N x
    BLOCK_K`` at most 8,192 elements (64 a thread at 4 warps), 8 outputs where that leaves fewer
    than 512 programs (4 per SM of an H100)."""
    bm = block_m(m)
    bk = block_k_max
    while bm * 2 * bk > 8192 and bk > 32:
        bk //= 2
    block_n = max(2, min(16, 8192 // (bm * bk)))
    if -(-n // block_n) < 512:
        block_n = max(2, min(block_n, 8))
    return {"BLOCK_M": bm, "BLOCK_N": block_n, "BLOCK_K": bk, "num_warps": 4, "num_stages": 3}


# int4 GEMV launches measured fastest on an H100 (srt/bench/tune_quant.py, 2026-12-07, the 8B
# projections): (rows <= 1, wide output) -> BLOCK_N, chunk features SUB, chunks NC, warps, stages
# ("wide": n >= 16,384 outputs, the MLP's up projection; else attention-sized outputs). One row
# reads 128-feature chunks, 1,024 features an iteration; a few rows read 32-feature chunks.
_INT4_GEMV_BEST = {
    (True, True): (32, 128, 8, 4, 2),
    (True, False): (16, 128, 8, 8, 4),
    (False, True): (32, 128, 2, 4, 4),
    (False, False): (16, 32, 32, 4, 2),
}


def int4_gemv_config(m: int, n: int, k: int, group: int) -> dict:
    """int4 GEMV launch parameters (deterministic), from the measured table above; ``SUB`` is
    lowered to the largest of 128, 64, 32 dividing the group (``NC`` raised to keep the features
    an iteration covers), and for more than 4 rows the partial sums (``BLOCK_M x BLOCK_N x NC x
    SUB / 8``) are kept at most 4,096 elements (fewer outputs, then fewer chunks)."""
    bm = block_m(m)
    block_n, sub, nc, warps, stages = _INT4_GEMV_BEST[(bm == 1, n >= 16384)]
    fit = int4_sub(group)
    if sub > fit:
        nc, sub = nc * sub // fit, fit
    if bm > 4:
        cw = sub // 8
        while bm * block_n * nc * cw > 4096 and block_n > 4:
            block_n //= 2
        while bm * block_n * nc * cw > 4096 and nc > 1:
            nc //= 2
    return {
        "BLOCK_M": bm,
        "BLOCK_N": block_n,
        "SUB": sub,
        "NC": nc,
        "num_warps": warps,
        "num_stages": stages,
    }


def fp8_gemv(x2, w8, w_scale, block_k: int | None, cfg=None) -> torch.Tensor:
    """``x2`` ``[M, K]`` (``M <= 16``, unquantised) times the FP8 weight dequantised in
    registers -> ``[M, N]`` ``x2.dtype``. ``block_k``: the scales' block width (a power of two
    >= 16), None for one scale per row."""
    x2 = x2.contiguous()
    m, k = x2.shape
    n = w8.shape[0]
    bk = 256 if block_k is None else min(block_k, 128)
    conf = {**gemv_config(m, n, k, bk), **(cfg or {})}
    if conf["BLOCK_M"] < m:
        raise ValueError(f"BLOCK_M {conf['BLOCK_M']} is fewer than the {m} rows")
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    grid = (triton.cdiv(n, conf["BLOCK_N"]),)
    _jit_gemv("fp8")[grid](
        x2,
        w8,
        w_scale,
        y,
        m,
        n,
        k,
        x2.stride(0),
        w8.stride(0),
        w_scale.stride(0),
        y.stride(0),
        SCALE_K=0 if block_k is None else block_k,
        BLOCK_M=conf["BLOCK_M"],
        BLOCK_N=conf["BLOCK_N"],
        BLOCK_K=conf["BLOCK_K"],
        NUM_STAGES=conf["num_stages"],
        num_warps=conf["num_warps"],
    )
    return y


def int4_gemv(x2, qweight, scales, zeros, cfg=None) -> torch.Tensor:
    """``x2`` ``[M, K]`` (``M <= 16``) times the int4 weight transposed -> ``[M, N]``; the group
    (``K / scales.shape[1]``) a multiple of 32."""
    x2 = x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[0]
    group = k // scales.shape[1]
    conf = {**int4_gemv_config(m, n, k, group), **(cfg or {})}
    if conf["BLOCK_M"] < m:
        raise ValueError(f"BLOCK_M {conf['BLOCK_M']} is fewer than the {m} rows")
    if group % conf["SUB"]:
        raise ValueError(f"SUB {conf['SUB']} does not divide the group of {group} features")
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    grid = (triton.cdiv(n, conf["BLOCK_N"]),)
    _jit_gemv("int4")[grid](
        x2,
        qweight,
        scales,
        zeros,
        y,
        m,
        n,
        k,
        group,
        x2.stride(0),
        qweight.stride(0),
        scales.stride(0),
        y.stride(0),
        BLOCK_M=conf["BLOCK_M"],
        BLOCK_N=conf["BLOCK_N"],
        SUB=conf["SUB"],
        NC=conf["NC"],
        NUM_STAGES=conf["num_stages"],
        num_warps=conf["num_warps"],
    )
    return y
