"""Quantised linear layers: ``y = x @ W^T`` with FP8 (W8A8) or int4 (weight-only) weights.

Weight layouts (the models convert every checkpoint format into these at load):

* FP8: ``w8`` float8_e4m3fn ``[N, K]``; ``w_scale`` float32 ``[N, KB]``, one scale per output
  row and per ``block_k`` input features (``KB = ceil(K / block_k)``; ``KB = 1`` and
  ``block_k`` None for per-channel and per-tensor weights).
* int4: ``qweight`` int32 ``[N, K / 8]`` (feature ``8 c + i`` in bits ``4 i .. 4 i + 3`` of word
  ``c``, values 0..15); ``scales``, ``zeros`` ``[N, G]`` (``K / G`` features per group) in the
  activation dtype: ``w = (q - zero) * scale``.

Activations of FP8 layers are quantised at run time: per token (``"token"``: one scale per row,
amax / 448), per token and ``block_k`` block (``"block"``), or with the checkpoint's one
``input_scale`` (``"static"``).

Paths:

* CUDA, up to ``MM_ROWS`` rows (int4): ``int4_mm.int4_mm`` (Triton): nibbles turned into
  bf16/fp16 operands by packed bit operations (inline assembly, two weights an instruction),
  multiplied on tensor cores for all the rows of a tile, zero and scale applied per tile in
  fp32 (see its docstring), where a tile fits ``K`` and the group (``int4_mm.tile_fits``);
* CUDA, up to ``GEMV_ROWS`` rows (decode): ``quant_gemv.fp8_gemv`` / ``int4_gemv`` (Triton): the
  weight dequantised in registers times the activations as they are (for FP8 no activation
  quantisation: the exact weight's product, and no quantisation kernels in the step), one
  program per ``BLOCK_N`` outputs for all the rows (each weight tile read once), no
  tensor-core tile (the kernels take up to 16 rows; ``srt/bench/tune_quant.py`` times them
  against the tiled kernel at 8 and 16 rows);
* CUDA, FP8 per channel or tensor: :func:`torch._scaled_mm` with row-wise scales (bf16 out),
  the activations quantised per token by one Triton kernel (:func:`quantize_per_token`);
  FP8 blocks: :func:`_fp8_block_kernel` (Triton; ``tl.dot`` of e4m3 tiles, each ``block_k`` step
  scaled by its activation and weight scales in fp32);
* CUDA, int4, up to ``DEQUANT_ROWS`` rows where ``int4_mm``'s tiles do not fit (and up to
  ``GEMV_ROWS`` rows :func:`int4_gemv`): :func:`_int4_kernel` (Triton): loads each output's
  ``BLOCK_K / 8`` words of a tile once (contiguous), unpacks the nibbles by a broadcast shift
  into the ``[BLOCK_K, BLOCK_N]`` operand, turns them into floats with the 2^23 bit trick (no
  int -> float conversions) and dequantises them in registers (one scale and zero per output
  and tile: ``BLOCK_K`` divides the group), then ``tl.dot`` with the activations. Up to 64
  rows the K loop is split across programs that add fp32 partial sums atomically, so that an
  8B projection still has about two programs per SM. Above ``DEQUANT_ROWS`` rows (prefill,
  compute-bound) :func:`int4_dequant` writes the dense weight in one pass near copy bandwidth
  (2.5 bytes moved per weight) and ``F.linear`` (cuBLAS) multiplies it;
* elsewhere (CPUs): the torch reference: activations quantised and dequantised (the same
  rounding as the GPU paths), times the dequantised weight (``dense``, when the caller caches
  it, else dequantised per call).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None
    tl = None

from radixlm.kernels.int4_mm import int4_mm, tile_fits
from radixlm.kernels.quant_gemv import MAGIC, MAGIC_F, fp8_gemv, int4_gemv, int4_sub

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12
SPLIT_K_ROWS = 16
GEMV_ROWS = 4
DEQUANT_ROWS = 512
# int4_mm (kernels/int4_mm.py) serves up to MM_ROWS rows, ahead of the GEMV and the tiled kernel.
# H100, 8B projections (`bash srt/bench/gpu_runs.sh int4test int4tune`, docs/results/quant.md):
# 0.76-0.94x the GEMV's time at 1 row, 0.3-0.4x at 4; 0.4-0.8x the tiled kernel's at 16-256
# rows; 0.4-0.6x dequantise + cuBLAS at 256, 0.7-0.95x at 512, 1.05-1.25x at 1,024 (hence
# DEQUANT_ROWS). The older kernels stay for shapes its tiles do not fit.
MM_ROWS = DEQUANT_ROWS
SEQUENTIAL = tuple(range(8))


# --- packing and dequantisation (torch) -----------------------------------------------------


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = SEQUENTIAL):
    """int32 words -> uint8 values 0..15, eight per word along ``dim`` (nibble ``i`` of word
    ``c`` is item ``8 c + order[i]``)."""
    packed = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8] by nibble position
    inverse = [order.index(j) for j in range(8)]
    values = nibbles[..., inverse].flatten(-2)
    return values.to(torch.uint8).movedim(-1, dim)


def pack_int4(values: torch.Tensor, dim: int, order: tuple[int, ...] = SEQUENTIAL):
    """The inverse of :func:`unpack_int4`: values 0..15 along ``dim`` -> int32 words."""
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % 8:
        raise ValueError(f"cannot pack {v.shape[-1]} int4 values into int32 words (not /8)")
    v = v.unflatten(-1, (-1, 8))[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(-1, dim)


def dequantize_int4(qweight, scales, zeros, perm=None, dtype=torch.float32) -> torch.Tensor:
    """int4 layout -> dense ``[N, K]`` in ``dtype``; with ``perm`` (act-order) the columns go
    back to the checkpoint's order (column ``j`` of the stored weight is feature ``perm[j]``)."""
    q = unpack_int4(qweight, 1).to(dtype)
    group = q.shape[1] // scales.shape[1]
    w = (q - zeros.to(dtype).repeat_interleave(group, 1)) * scales.to(dtype).repeat_interleave(
        group, 1
    )
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


def _per_feature(scale: torch.Tensor, k: int, block_k: int | None) -> torch.Tensor:
    """Scales ``[R, KB]`` -> ``[R, K]``: ``KB == 1`` covers every feature, else each covers
    ``block_k`` (the last block may be partial)."""
    if scale.shape[1] == 1:
        return scale
    if block_k is None or -(-k // block_k) != scale.shape[1]:
        raise ValueError(
            f"{scale.shape[1]} scales per row do not fit {k} features in blocks of {block_k}"
        )
    return scale.repeat_interleave(block_k, dim=1)[:, :k]


def dequantize_fp8(w8, w_scale, dtype=torch.float32, block_k: int | None = None) -> torch.Tensor:
    """FP8 layout -> dense ``[N, K]`` in ``dtype`` (``block_k``: the scales' block width)."""
    return w8.to(dtype) * _per_feature(w_scale.to(dtype), w8.shape[1], block_k)


def quantize_activations(
    x: torch.Tensor, mode: str, block_k: int | None = None, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> (e4m3 ``[M, K]``, float32 scales ``[M, KB]``); ``KB`` is 1 for
    ``token`` and ``static``, ``ceil(K / block_k)`` for ``block``."""
    xf = x.float()
    if mode == "static":
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
        q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale.contiguous()
    if mode == "token":
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    if mode != "block":
        raise ValueError(f"unknown activation quantisation {mode!r}")
    m, k = xf.shape
    kb = -(-k // block_k)
    padded = F.pad(xf, (0, kb * block_k - k)).view(m, kb, block_k)
    scale = (padded.abs().amax(dim=2) / FP8_MAX).clamp_min(MIN_SCALE)  # [M, KB]
    q = (padded / scale.unsqueeze(2)).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def fp8_linear_reference(x2, w8, w_scale, mode, block_k, input_scale, dense=None):
    """The torch path: quantised-and-dequantised activations times the dequantised weight."""
    q, scale = quantize_activations(x2, mode, block_k, input_scale)
    xd = q.float() * _per_feature(scale, x2.shape[1], block_k)
    w = dense if dense is not None else dequantize_fp8(w8, w_scale, block_k=block_k)
    return F.linear(xd.to(w.dtype), w).to(x2.dtype)


# --- entry points ---------------------------------------------------------------------------


def fp8_linear(x, w8, w_scale, mode, block_k=None, input_scale=None, dense=None):
    """``x`` ``[..., K]`` -> ``[..., N]`` in ``x``'s dtype (see the module docstring)."""
    x2 = x.reshape(-1, x.shape[-1])
    _check_dense(dense, x2)
    if x2.is_cuda and dense is None and x2.shape[0] > 0:
        y = _fp8_cuda(x2, w8, w_scale, mode, block_k, input_scale)
    else:
        y = fp8_linear_reference(x2, w8, w_scale, mode, block_k, input_scale, dense)
    return y.reshape(*x.shape[:-1], w8.shape[0])


def int4_linear(x, qweight, scales, zeros, perm=None, dense=None):
    """``x`` ``[..., K]`` -> ``[..., N]`` in ``x``'s dtype; ``dense``: the caller's cached
    dequantised weight (columns in the checkpoint's order), used instead of the kernel."""
    x2 = x.reshape(-1, x.shape[-1])
    n = qweight.shape[0]
    _check_dense(dense, x2)
    if dense is not None:
        y = F.linear(x2.to(dense.dtype), dense).to(x.dtype)
    elif int4_supported(x2, qweight, scales):
        y = int4_gemm(x2 if perm is None else x2[:, perm], qweight, scales, zeros)
    else:
        w = dequantize_int4(qweight, scales, zeros, perm, x.dtype)
        y = F.linear(x2, w)
    return y.reshape(*x.shape[:-1], n)


def _check_dense(dense: torch.Tensor | None, x2: torch.Tensor) -> None:
    if dense is not None and dense.device != x2.device:
        raise ValueError(
            f"the dequantised weight is on {dense.device}, the activations on {x2.device} "
            "(the dense cache is for CPU layers only)"
        )


def _fp8_cuda(x2, w8, w_scale, mode, block_k, input_scale):
    n, k = w8.shape
    if x2.shape[0] <= GEMV_ROWS and triton is not None and _gemv_fits(block_k, w_scale):
        return fp8_gemv(x2, w8, w_scale, block_k)
    if block_k is None and mode in ("token", "static") and k % 16 == 0 and n % 16 == 0:
        if mode == "token" and triton is not None:
            q, a_scale = quantize_per_token(x2)  # one kernel instead of torch's six
        else:
            q, a_scale = quantize_activations(x2, mode, None, input_scale)
        y = torch._scaled_mm(
            q,
            w8.t(),
            scale_a=a_scale.contiguous(),
            scale_b=w_scale.reshape(1, n).contiguous(),
            out_dtype=torch.bfloat16,
        )
        return y.to(x2.dtype)
    if block_k is not None and mode == "block" and triton is not None:
        q, a_scale = quantize_activations(x2, mode, block_k)
        return fp8_block_gemm(q, a_scale, w8, w_scale, block_k, x2.dtype)
    return fp8_linear_reference(x2, w8, w_scale, mode, block_k, input_scale)


# --- Triton: FP8 with block scales ----------------------------------------------------------


def _fp8_block_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    as_ptr,
    bs_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``C = A B^T``; ``BLOCK_K`` is the scale block."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_n[None, :] * stride_bn + k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        a_s = tl.load(as_ptr + offs_m * stride_asm + kb, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptr + offs_n * stride_bsn + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
        c,
        mask=mask_m[:, None] & mask_n[None, :],
    )


@functools.cache
def _jit_fp8():
    return triton.jit(_fp8_block_kernel)


def fp8_block_config(m: int) -> dict:
    """Tile sizes for ``M`` rows (deterministic: a CUDA graph captures the same launch)."""
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def fp8_block_gemm(a, a_scale, b, b_scale, block_k: int, out_dtype, cfg=None) -> torch.Tensor:
    """``a`` e4m3 ``[M, K]`` (scales ``[M, KB]``) times ``b`` e4m3 ``[N, K]`` (scales
    ``[N, KB]``) transposed -> ``[M, N]`` ``out_dtype``. ``block_k``: a power of two >= 16."""
    m, k = a.shape
    n = b.shape[0]
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    conf = {**fp8_block_config(m), **(cfg or {})}
    grid = (triton.cdiv(m, conf["BLOCK_M"]) * triton.cdiv(n, conf["BLOCK_N"]),)
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    _jit_fp8()[grid](
        a,
        b,
        c,
        a_scale,
        b_scale,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        c.stride(0),
        a_scale.stride(0),
        b_scale.stride(0),
        BLOCK_M=conf["BLOCK_M"],
        BLOCK_N=conf["BLOCK_N"],
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=conf["num_warps"],
        num_stages=conf["num_stages"],
    )
    return c


# --- Triton: int4 weight-only ---------------------------------------------------------------


def _int4_kernel(
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
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """``y[M, N] (+)= x[M, K] @ dequant(q)[N, K]^T`` over this program's share of ``K``. Each
    output's ``BLOCK_K / 8`` words of the tile are one contiguous load (each word once: no
    per-feature gather), unpacked by a broadcast shift into ``[BLOCK_K / 8, 8, BLOCK_N]``
    (reshaped to the ``[BLOCK_K, BLOCK_N]`` operand of ``tl.dot``, no transpose: with the
    ``[BLOCK_N, BLOCK_K]`` orientation and a transpose the compiler used all 255 registers
    and spilled), turned into floats by the 2^23 bit trick and dequantised with one FMA
    (``q s - z s``)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // grid_n
    pid_n = pid % grid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4  # feature 8 c + i: nibble i of word c
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    iters = K // (BLOCK_K * SPLIT_K)
    for it in range(0, iters):
        k0 = (pid_k * iters + it) * BLOCK_K  # a multiple of BLOCK_K the compiler can see
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
            mask=mask_m[:, None],
            other=0.0,
        )
        words = tl.load(
            q_ptr + offs_n[None, :] * stride_qn + (k0 // 8 + offs_w)[:, None],
            mask=mask_n[None, :],
            other=0,
        )  # [BLOCK_K / 8, BLOCK_N]
        bits = ((words[:, None, :] >> shifts[None, :, None]) & 0xF) | MAGIC
        q = tl.reshape(bits, (BLOCK_K, BLOCK_N)).to(tl.float32, bitcast=True) - MAGIC_F
        g = k0 // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
        w = (q * s[None, :] - (z * s)[None, :]).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w)
    offs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(offs, acc, mask=mask)


@functools.cache
def _jit_int4():
    return triton.jit(_int4_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def int4_block_k(k: int, group: int) -> int | None:
    """The K tile: it must divide the group (one scale per row and tile) and K."""
    for bk in (128, 64, 32):
        if group % bk == 0 and k % bk == 0:
            return bk
    return None


def int4_config(m: int, n: int, k: int, group: int) -> dict:
    """Launch parameters of the tiled kernel (deterministic), Hopper-sized: ``BLOCK_K`` 128
    where the group allows; 16x64 tiles up to ``SPLIT_K_ROWS`` rows, 64x64 up to 64, 64x128 up
    to 128, 128x128 above. Up to 64 rows ``K`` is split (fp32 partial sums added atomically)
    until there are about 2 programs per SM of an H100 (264), at most 8 ways."""
    bk = int4_block_k(k, group)
    if m <= SPLIT_K_ROWS:
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 4
    elif m <= 128:
        block_m, block_n, warps, stages = 64, 128, 4, 3
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    tiles = -(-m // block_m) * -(-n // block_n)
    split = 1
    while m <= 64 and split < 8 and tiles * split < 264 and k % (bk * split * 2) == 0:
        split *= 2
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": bk,
        "SPLIT_K": split,
        "num_warps": warps,
        "num_stages": stages,
    }


def int4_supported(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether :func:`int4_gemm` serves these shapes: Triton, CUDA (or the interpreter), an
    activation dtype of bf16/fp16 equal to the scales', ``K`` and the group split in tiles."""
    if triton is None or not (x2.is_cuda or _interpreting()) or x2.shape[0] == 0:
        return False
    if x2.dtype not in (torch.bfloat16, torch.float16) or scales.dtype != x2.dtype:
        return False
    k = qweight.shape[1] * 8
    return x2.shape[1] == k and int4_block_k(k, k // scales.shape[1]) is not None


def _gemv_fits(block_k: int | None, w_scale: torch.Tensor) -> bool:
    """The FP8 GEMV's scale layouts: one per row, or blocks of a power of two >= 16."""
    if block_k is None:
        return w_scale.shape[1] == 1
    return block_k >= 16 and not block_k & (block_k - 1)


def _mm_fits(k: int, groups: int) -> bool:
    return any(tile_fits(b, k, k // groups) for b in (128, 64, 32, 16))


def int4_gemm(x2, qweight, scales, zeros, cfg=None) -> torch.Tensor:
    """``x2`` ``[M, K]`` bf16/fp16 times the int4 weight transposed -> ``[M, N]`` ``x2.dtype``:
    up to ``MM_ROWS`` rows :func:`int4_mm.int4_mm`, then up to ``GEMV_ROWS`` :func:`int4_gemv`,
    up to ``DEQUANT_ROWS`` the tiled kernel, above dequantise + cuBLAS; ``cfg`` runs the tiled
    kernel with those launch parameters."""
    x2 = x2.contiguous()
    if x2.shape[0] <= MM_ROWS and cfg is None and _mm_fits(x2.shape[1], scales.shape[1]):
        return int4_mm(x2, qweight, scales, zeros)
    if x2.shape[0] <= GEMV_ROWS and cfg is None:
        return int4_gemv(x2, qweight, scales, zeros)
    if x2.shape[0] > DEQUANT_ROWS and cfg is None:  # compute-bound: cuBLAS on the dense tile
        return F.linear(x2, int4_dequant(qweight, scales, zeros, x2.dtype))
    m, k = x2.shape
    n = qweight.shape[0]
    group = k // scales.shape[1]
    conf = {**int4_config(m, n, k, group), **(cfg or {})}
    split = conf["SPLIT_K"]
    out = (
        torch.zeros((m, n), dtype=torch.float32, device=x2.device)
        if split > 1
        else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    )
    grid = (triton.cdiv(m, conf["BLOCK_M"]) * triton.cdiv(n, conf["BLOCK_N"]), split)
    _jit_int4()[grid](
        x2,
        qweight,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        group,
        x2.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        BLOCK_M=conf["BLOCK_M"],
        BLOCK_N=conf["BLOCK_N"],
        BLOCK_K=conf["BLOCK_K"],
        SPLIT_K=split,
        num_warps=conf["num_warps"],
        num_stages=conf["num_stages"],
    )
    return out if split == 1 else out.to(x2.dtype)


# --- Triton: int4 -> dense, for many rows (prefill) ------------------------------------------
# Above DEQUANT_ROWS rows the matmul is compute-bound: the weight is dequantised into a dense
# [N, K] buffer in one pass (0.5 byte read, 2 written per weight) and cuBLAS multiplies it.


def _int4_dequant_kernel(
    q_ptr,
    s_ptr,
    z_ptr,
    w_ptr,
    N,
    K,
    GROUP,
    stride_qn,
    stride_sn,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``[BLOCK_N, BLOCK_K]`` tile (``BLOCK_K`` divides the group: one scale and zero per
    row): each row's ``BLOCK_K / 8`` words in one contiguous load, all eight nibbles of each
    written as ``[BLOCK_N, BLOCK_K / 8, 8]`` (eight consecutive outputs a word: wide stores),
    no reshape and no per-feature gather of words or scales."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    mask_n = offs_n < N
    mask = mask_n[:, None] & (c < K // 8)[None, :]
    words = tl.load(q_ptr + offs_n[:, None] * stride_qn + c[None, :], mask=mask, other=0)
    bits = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) | MAGIC
    q = bits.to(tl.float32, bitcast=True) - MAGIC_F  # [BLOCK_N, BLOCK_K / 8, 8]
    g = (pid_k * BLOCK_K) // GROUP
    s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
    w = q * s[:, None, None] - (z * s)[:, None, None]
    ptrs = w_ptr + offs_n[:, None, None] * stride_wn + (c * 8)[None, :, None]
    tl.store(
        ptrs + tl.arange(0, 8)[None, None, :],
        w.to(w_ptr.dtype.element_ty),
        mask=mask[:, :, None],
    )


@functools.cache
def _jit_dequant():
    return triton.jit(_int4_dequant_kernel)


def int4_dequant(qweight, scales, zeros, dtype, block_n: int = 32) -> torch.Tensor:
    """The int4 layout -> dense ``[N, K]`` ``dtype`` on the device (columns in stored order);
    tiles of ``block_n`` rows and the largest of 128, 64, 32 features dividing the group (16 KiB
    written a program at ``block_n`` 32 and 128 features, bf16)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    group = k // scales.shape[1]
    w = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_k = int4_sub(group)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _jit_dequant()[grid](
        qweight,
        scales,
        zeros,
        w,
        n,
        k,
        group,
        qweight.stride(0),
        scales.stride(0),
        w.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return w


# --- Triton: per-token activation quantisation in one kernel ---------------------------------


def _quant_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    """Row ``m``: scale = max(amax / 448, MIN_SCALE); q = clamp(x / scale) as e4m3 (the torch
    path's arithmetic)."""
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + m * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _jit_quant_token():
    return triton.jit(_quant_token_kernel)


def quantize_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_activations` ``"token"`` in one Triton kernel: (e4m3 ``[M, K]``, float32
    scales ``[M, 1]``)."""
    x2 = x2.contiguous()
    m, k = x2.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x2.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    _jit_quant_token()[(m,)](x2, q, scale, k, x2.stride(0), q.stride(0), BLOCK=1024, num_warps=4)
    return q, scale
