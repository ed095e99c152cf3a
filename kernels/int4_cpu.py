"""Weight-only int4 linear layers on the CPU, for small-batch decode.

At batch 1 a CPU decode step is bound by the bytes of weight it reads; 4-bit weights read about
8x fewer bytes than float32 ones. The format: groups of ``GROUP_SIZE`` weights along the input
dim, asymmetric, 16 levels per group::

    scale = (max - min) / 15,   code = round((w - min) / scale) in 0..15,   w ~ code * scale + min

with ``scale`` and ``min`` rounded to float16 (as GGUF stores them; the C++ kernels read them
so) before the codes are picked, so that the codes fit the values they are multiplied with.

This is GGUF's Q4_1 block format (its ``d`` and ``m`` are our ``scale`` and ``min``): Q4_1 maps
each block's minimum to code 0 and its maximum to code 15, so quantizing dequantized Q4_1
weights recovers the file's own codes, scales and mins. For weights that were not Q4_1 it is
lossy (the float16 rounding adds at most ``2**-11`` of ``|min| + 15 * scale`` to an element's
error, against half a step from the codes).

Up to ``gguf_cpu.matmul_rows()`` rows (``MATMUL_ROWS``, 128) the matmul is ``gguf_cpu.py``'s
C++ Q4_1 kernel (int8 activations, integer dot products, as llama.cpp multiplies Q4_1): faster
than the float32 dense weight up to there. Where that library is off or not built it is torch's
packed int4 CPU kernel (``_weight_int4pack_mm_for_cpu``), whose convention is
``w = (code - 8) * scale + zero'``, so ``zero' = min + 8 * scale``; scales and zeros are stored
in bfloat16 and activations are cast to bfloat16 (float32 activations run a slow path there). It
is slower than a float32 dense matmul once a few rows share the weight read, so it takes at most
``PACKED_INT4_ROWS`` rows. :class:`Int4Linear` keeps the dense weight for more rows (prefill).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixlm.kernels import gguf_cpu

GROUP_SIZE = 32
NUM_LEVELS = 16
# Token rows up to which torch's packed int4 kernel (and the LM head's per-channel int8 one) is
# used when the C++ kernels are not (those take up to gguf_cpu.matmul_rows()). Measured on the
# 2-core AVX2 dev CPU, whole SmolLM2-135M decode steps (cold weights, unlike a matmul timed in a
# loop): the packed kernels beat the float32 dense weights at 1-16 rows (e.g. 31 vs 47 ms at 1,
# 125 vs 153 ms at 16) and lose from 24 rows on (227 vs 208 ms).
PACKED_INT4_ROWS = 16
# Rows up to which a forward with prompt tokens (prefill, mixed steps) takes the int4 paths; more
# keep the prompt's activations float32 in the dense weights (model_runner sets it per forward:
# with int8 ones, a 40-token chat prompt's prefill changed SmolLM2's answer).
PROMPT_ROWS = 16


def small_rows_limit(native: bool) -> int:
    """Rows up to which an int4 model's layers and LM head take their small-batch paths now:
    the C++ kernels' limit where they run (``native``), else torch's packed kernels'."""
    return gguf_cpu.matmul_rows() if native else PACKED_INT4_ROWS


_PACK_N_MULTIPLE = 16  # the packing op wants the output dim divisible by 16


class Int4Codes(NamedTuple):
    codes: torch.Tensor  # [N, K] uint8, 0..15
    scales: torch.Tensor  # [N, K / group] float32, float16 values
    mins: torch.Tensor  # [N, K / group] float32, float16 values


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Codes:
    """Asymmetric min/max quantization of ``weight`` ``[N, K]`` in groups along K, the scales
    and mins rounded to float16 before the codes are picked."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    mins, maxs = groups.amin(-1), groups.amax(-1)
    scales = ((maxs - mins) / (NUM_LEVELS - 1)).half().float()
    mins = mins.half().float()
    if not (scales.isfinite().all() and mins.isfinite().all()):
        raise ValueError("int4 weights must lie within float16's range (|w| < 65504)")
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))  # flat groups: code 0
    codes = ((groups - mins[..., None]) * inv[..., None]).round_().clamp_(0, NUM_LEVELS - 1)
    return Int4Codes(codes.to(torch.uint8).reshape(n, k), scales, mins)


def dequantize_int4(q: Int4Codes) -> torch.Tensor:
    """``[N, K]`` float32: ``code * scale + min`` (the reference for the packed kernel)."""
    n, k = q.codes.shape
    groups = q.codes.float().reshape(n, q.scales.shape[1], -1)
    return (groups * q.scales[..., None] + q.mins[..., None]).reshape(n, k)


def can_pack_int4(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> bool:
    return out_features % _PACK_N_MULTIPLE == 0 and in_features % group_size == 0


class PackedInt4(NamedTuple):
    weight: torch.Tensor  # [N, K / 2] uint8, the kernel's layout
    scales_and_zeros: torch.Tensor  # [K / group, N, 2] bfloat16: (scale, min + 8 * scale)
    group_size: int


def pack_int4(q: Int4Codes) -> PackedInt4:
    n, k = q.codes.shape
    group_size = k // q.scales.shape[1]
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.codes.to(torch.int32), 1)
    zeros = q.mins + (NUM_LEVELS // 2) * q.scales
    scales_and_zeros = torch.stack([q.scales.t(), zeros.t()], dim=-1).to(torch.bfloat16)
    return PackedInt4(weight, scales_and_zeros.contiguous(), group_size)


def int4_matmul(x: torch.Tensor, packed: PackedInt4) -> torch.Tensor:
    """``x`` ``[M, K]`` (any float dtype) times the packed ``[N, K]`` weight transposed:
    ``[M, N]`` bfloat16."""
    x16 = x.to(torch.bfloat16).contiguous()
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x16, packed.weight, packed.group_size, packed.scales_and_zeros
    )


class Int4Linear:
    """``x W^T + b`` with ``W`` held twice: packed int4 for small row counts (decode) and the
    original dense tensor for larger ones (prefill, big batches), where the dense matmul wins.

    ``weight`` ``[N, K]`` stays referenced, not copied; the output has ``x``'s dtype.
    ``max_int4_rows``: a row limit of its own for the int4 paths (tests); None follows the
    kernels' (``gguf_cpu.matmul_rows()`` for the C++ one, ``PACKED_INT4_ROWS`` for torch's).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        max_int4_rows: int | None = None,
    ):
        if weight.device.type != "cpu":
            raise ValueError(f"int4 weights are CPU-only, got a weight on {weight.device}")
        self.out_features, self.in_features = weight.shape
        if not can_pack_int4(self.out_features, self.in_features):
            raise ValueError(
                f"cannot pack a [{self.out_features}, {self.in_features}] weight as int4: "
                f"out_features must be a multiple of {_PACK_N_MULTIPLE}, "
                f"in_features of {GROUP_SIZE}"
            )
        self.dense_weight = weight  # [N, K] model dtype
        self.bias = bias  # [N] model dtype or None
        codes = quantize_int4(weight)
        self.packed = pack_int4(codes)
        self.q4_1 = gguf_cpu.pack_q4_1(*codes)  # the same codes in GGUF's blocks (C++ GEMV)
        self.max_int4_rows = max_int4_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the decode step's shape: no reshapes (each op costs its dispatch)
        rows = x.shape[0] if flat else x.numel() // self.in_features
        native = gguf_cpu.available()
        limit = self.max_int4_rows
        if rows > (small_rows_limit(native) if limit is None else limit):
            return F.linear(x, self.dense_weight, self.bias)
        x2 = x if flat else x.reshape(rows, self.in_features)
        if gguf_cpu.serves(x2, rows) and x2.stride(-1) == 1:  # int8 activations, integer dots
            y = gguf_cpu.q4_1_matmul(x2, self.q4_1)
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
        else:
            y = int4_matmul(x2, self.packed).to(x.dtype)
        if self.bias is not None:
            y += self.bias
        return y if flat else y.view(*x.shape[:-1], self.out_features)
