"""int4 weight-only matmul for decode and small batches (Triton): ``y = x @ dequant(W)^T`` for
1 to ``quant_gemm.DEQUANT_ROWS`` rows, each weight tile read once for all the rows of a
``BLOCK_M`` tile and multiplied on tensor cores (``tl.dot``; rows padded to 16).

The weight layout is ``kernels/quant_gemm.py``'s (``qweight`` int32 ``[N, K / 8]``, feature
``8 c + i`` in nibble ``i`` of word ``c``), read as int16 ``[N, K / 4]``: on a little-endian
device int16 ``h`` holds features ``4 h .. 4 h + 3`` in its nibbles 0..3.

Conversion (CUDA): two int16 at a time in one 32-bit register, two weights an instruction, no
int -> float conversions:

* ``(r >> 4 i) & 0x000F000F | MAGIC`` puts nibble ``i`` of both halves into the mantissas of a
  pair of 16-bit floats (one ``lop3``): bf16 ``0x4300 | q`` reads as ``128 + q``, fp16
  ``0x6400 | q`` as ``1024 + q``;
* one packed FMA with 1 and ``-(BIAS + zero)`` leaves ``q - zero``, a small integer, exactly;
* the scale is applied per tile in fp32 to the dot's result, not per weight.

About 2.5 lane-instructions a weight in the K loop at 1-16 rows (``srt/bench/sass_loop.py``),
against about eight for the fp32 path of ``kernels/quant_gemv.py``. The zeros must be integers
(every supported format's zero points are: 0..16). The operand's K order inside a tile is
nibble-major and the activations are permuted to match (see the kernel). Under the Triton
interpreter (CPU tests) the same values come from plain Triton operations in fp32 (``ASM``
off): inline assembly cannot run there.

Launch parameters: :func:`int4_mm_config` (deterministic, for CUDA graphs); ``cfg=`` overrides
them (``srt/bench/tune_quant.py`` sweeps them).
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None
    tl = None


def _convert_asm(magic: int, one: int, fma: str) -> str:
    """PTX of one pair of int16 (``$4``) and the pair ``-(BIAS + zero)`` (``$5``) -> four pairs
    of 16-bit floats ``$0..$3``: nibble ``i`` of both int16 minus the zero in ``$i``. The
    ``lop3`` puts the nibble into the mantissa (``BIAS + q`` exactly), the packed FMA with 1
    subtracts ``BIAS + zero`` (``q - zero``: a small integer, exact)."""
    lines = ["{", ".reg .b32 t<3>, one;", f"mov.b32 one, {one:#010x};"]
    lines += [f"shr.b32 t{i - 1}, $4, {4 * i};" for i in (1, 2, 3)]
    for i, src in enumerate(("$4", "t0", "t1", "t2")):  # (src & 0x000F000F) | magic
        lines.append(f"lop3.b32 ${i}, {src}, 0x000F000F, {magic:#010x}, 0xEA;")
    lines += [f"{fma} ${i}, ${i}, one, $5;" for i in range(4)]
    return "\n".join([*lines, "}"])


# constexpr globals: a Triton kernel may read no other module-level names
if tl is not None:  # bf16 0x4300 | q = 128 + q, fp16 0x6400 | q = 1024 + q; 1.0 in each
    ASM_BF16 = tl.constexpr(_convert_asm(0x43004300, 0x3F803F80, "fma.rn.bf16x2"))
    ASM_FP16 = tl.constexpr(_convert_asm(0x64006400, 0x3C003C00, "fma.rn.f16x2"))


def _int4_mm_kernel(
    x_ptr,
    h_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    ws_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_hn,
    stride_sn,
    stride_ym,
    SPLIT_K,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ASM: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """``y[m-tile, n-tile] = x[m-tile] @ dequant(W)[n-tile]^T``, this program's share of ``K``
    (``BLOCK_K`` divides ``K``; a group divides it or it divides the group). An iteration takes
    ``BLOCK_K`` features in dots of ``GK = min(BLOCK_K, GROUP)`` (one scale and zero per output
    and dot): it converts a ``[BLOCK_N, GK / 4]`` tile of int16 into the operand ``q - z``
    (exact), multiplies it with the activations, ``dot(v, x^T)`` (the weight tile is the MMA's
    A operand, the rows its N: Hopper's wgmma from ``BLOCK_N`` 64), and adds the product times
    the scales in fp32. With ``SPLIT_K`` > 1 each program writes its fp32 part of the
    tile to ``ws`` and counts itself in ``count[tile]``; the last one adds the parts in order
    (deterministic), stores the tile and resets the count to 0."""
    BIAS: tl.constexpr = 128.0 if IS_BF16 else 1024.0
    GK: tl.constexpr = BLOCK_K if BLOCK_K <= GROUP else GROUP  # features a dot: one scale
    QH: tl.constexpr = GK // 4
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    h_rows = h_ptr + offs_n[:, None] * stride_hn + tl.arange(0, QH)[None, :]
    x_rows = x_ptr + offs_m[:, None] * stride_xm + tl.arange(0, GK)[None, :]
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    tiles = K // BLOCK_K
    per_split = tl.cdiv(tiles, SPLIT_K)
    for it in range(pid_k * per_split, min(tiles, (pid_k + 1) * per_split)):
        for sub in tl.static_range(BLOCK_K // GK):  # groups smaller than the tile: one each
            k0 = it * BLOCK_K + sub * GK  # a multiple of GK the compiler can see
            h = tl.load(h_rows + k0 // 4, mask=mask_n[:, None], other=0)  # [BLOCK_N, QH]
            g = offs_n * stride_sn + k0 // GROUP
            s = tl.load(s_ptr + g, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g, mask=mask_n, other=0.0).to(tl.float32)
            if ASM:
                nz = tl.broadcast_to((-(z + BIAS)).to(dt)[:, None], (BLOCK_N, QH))  # integers
                v0, v1, v2, v3 = tl.inline_asm_elementwise(
                    ASM_BF16 if IS_BF16 else ASM_FP16,
                    "=r,=r,=r,=r,r,r",
                    [h, nz],
                    (dt, dt, dt, dt),
                    is_pure=True,
                    pack=2,
                )
            else:  # the same values (the interpreter runs no inline assembly)
                v0 = (((h >> 0) & 0xF).to(tl.float32) - z[:, None]).to(dt)
                v1 = (((h >> 4) & 0xF).to(tl.float32) - z[:, None]).to(dt)
                v2 = (((h >> 8) & 0xF).to(tl.float32) - z[:, None]).to(dt)
                v3 = (((h >> 12) & 0xF).to(tl.float32) - z[:, None]).to(dt)
            # the operand's feature order: nibble-major (column i QH + h holds feature 4 h + i),
            # so the converted pairs are the operand's register pairs; the activations are
            # permuted the same way (the sum over K does not depend on the order)
            v = tl.permute(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (0, 2, 3, 1))
            v = tl.reshape(v, (BLOCK_N, GK))  # [n, r, p, h] = nibble 2 r + p of int16 h
            x = tl.load(x_rows + k0, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, GK]
            x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, QH, 4)), (0, 2, 1)), (BLOCK_M, GK))
            acc += s[:, None] * tl.dot(v, tl.trans(x))  # [BLOCK_N, BLOCK_M]
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # the last of the tile's programs to finish adds the parts, in order
        tile = pid_m * tl.num_programs(0) + pid_n
        offs_t = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        parts = ws_ptr + tile * (SPLIT_K * BLOCK_M * BLOCK_N) + offs_t
        tl.store(parts + pid_k * (BLOCK_M * BLOCK_N), acc)
        tl.debug_barrier()  # every thread's part stored before the count is released
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.load(parts, cache_modifier=".cg")
            for p in range(1, SPLIT_K):
                total += tl.load(parts + p * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            tl.store(ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch


_COUNTS: dict = {}


def _counts(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K arrival counts of ``device``'s current stream: int32, zero between launches
    (each kernel's last program resets its tile's). One array per stream: launches on one
    stream run one after another, so they never share a count."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    counts = _COUNTS.get(key)
    if counts is None or counts.numel() < tiles:
        counts = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
        _COUNTS[key] = counts
    return counts


@functools.cache
def _jit():
    # rows and splits vary from call to call: no recompiles for M == 1 or M % 16 == 0
    return triton.jit(_int4_mm_kernel, do_not_specialize=["M", "SPLIT_K"])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def tile_fits(block_k: int, k: int, group: int) -> bool:
    """Whether a ``block_k`` tile fits: it divides ``K``, and it divides the group or the group
    divides it (one scale and zero per output and dot of ``min(block_k, group)`` features, at
    least the MMA's 16)."""
    fits_group = group % block_k == 0 or block_k % group == 0
    return k % block_k == 0 and fits_group and min(block_k, group) >= 16


@functools.cache
def _sm_count(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100's (the interpreter: any fixed number)


def int4_mm_config(m: int, n: int, k: int, group: int, sms: int = 132) -> dict:
    """Launch parameters (deterministic for a device with ``sms`` SMs), from the H100 sweep of
    ``srt/bench/tune_quant.py`` (docs/results/quant.md). ``BLOCK_M`` the rows rounded up to a
    power of two from 16 (at most 128); ``BLOCK_K`` the first of 128, 64, 32, 16 that
    :func:`tile_fits`. Up to 16 rows (decode, bound by the weight bytes): ``BLOCK_N`` 64, four
    warps, ``K`` split to the power of two nearest 2.5 programs an SM; above: ``BLOCK_N`` 128,
    eight warps, nearest one program an SM. Splits keep at least two tiles each, at most 16."""
    bm = min(128, max(16, 1 << max(m - 1, 0).bit_length()))
    bk = next(b for b in (128, 64, 32, 16) if tile_fits(b, k, group))
    if bm == 16:
        bn, warps, stages, per_sm = 64, 4, 4, 2.5
    else:
        bn, warps, stages, per_sm = 128, 8, 3, 1.0
    if n < bn:
        bn = 64
    tiles, ktiles = -(-n // bn) * -(-m // bm), k // bk
    want = per_sm * sms / tiles
    split = 1 << max(0, round(math.log2(want))) if want > 1 else 1
    split = max(1, min(16, ktiles // 2, split))
    split = -(-ktiles // -(-ktiles // split))  # no split left without a tile
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "SPLIT_K": split,
        "num_warps": warps,
        "num_stages": stages,
    }


def int4_mm(x2, qweight, scales, zeros, cfg=None) -> torch.Tensor:
    """``x2`` ``[M, K]`` bf16/fp16 times the int4 weight transposed -> ``[M, N]`` ``x2.dtype``
    (``K`` a multiple of 32, the scales in ``x2``'s dtype, integer zeros). ``cfg`` may also set
    ``ASM`` (default: on CUDA outside the interpreter)."""
    x2 = x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[0]
    group = k // scales.shape[1]
    conf = {**int4_mm_config(m, n, k, group, _sm_count(str(x2.device))), **(cfg or {})}
    if not tile_fits(conf["BLOCK_K"], k, group):
        raise ValueError(
            f"BLOCK_K {conf['BLOCK_K']} does not divide K {k} and groups of {group} features"
        )
    asm = conf.get("ASM", x2.is_cuda and not _interpreting())
    split = conf["SPLIT_K"]
    grid = (triton.cdiv(n, conf["BLOCK_N"]), triton.cdiv(m, conf["BLOCK_M"]), split)
    tiles = grid[0] * grid[1]
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    ws = torch.empty(
        (tiles * split * conf["BLOCK_M"] * conf["BLOCK_N"],) if split > 1 else (1,),
        dtype=torch.float32,
        device=x2.device,
    )
    h = qweight.contiguous().view(torch.int16)  # [N, K / 4]
    _jit()[grid](
        x2,
        h,
        scales,
        zeros,
        out,
        ws,
        _counts(x2.device, tiles),
        m,
        n,
        k,
        x2.stride(0),
        h.stride(0),
        scales.stride(0),
        out.stride(0),
        split,
        GROUP=group,
        BLOCK_M=conf["BLOCK_M"],
        BLOCK_N=conf["BLOCK_N"],
        BLOCK_K=conf["BLOCK_K"],
        ASM=bool(asm),
        IS_BF16=x2.dtype == torch.bfloat16,
        num_warps=conf["num_warps"],
        num_stages=conf["num_stages"],
    )
    return out
