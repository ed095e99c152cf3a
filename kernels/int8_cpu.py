"""Weight-only int8 matmul on the CPU: symmetric, one scale per output channel.

``w ~ code * scale`` with ``scale = max|w_row| / 127`` and codes in -127..127, multiplied by
torch's ``_weight_int8pack_mm`` with bfloat16 activations and scales. It serves the LM head
under ``--quantization int4`` (see ``radixlm.srt.models.quantize``): a vocabulary-sized matrix
that 4-bit groups would blur, read at a quarter of its float32 bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_CODE = 127

# torch's packed int8 CPU kernel reads the reduction dimension in blocks of 16. On AVX-512
# machines (seen with torch 2.13 on a Xeon) other K values crash the process with more than one
# row and give NaN with one row (K=56, K=100); K % 16 == 0 was correct for every N and M tried.
# Other shapes take the same arithmetic on plain torch ops.
PACKED_K_MULTIPLE = 16


def can_use_packed_int8(in_features: int) -> bool:
    """Whether ``torch._weight_int8pack_mm`` is safe for a ``[N, in_features]`` weight."""
    return in_features > 0 and in_features % PACKED_K_MULTIPLE == 0


class Int8Weight(NamedTuple):
    codes: torch.Tensor  # [N, K] int8, -127..127
    scales: torch.Tensor  # [N] float32


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Per-row symmetric quantization of ``weight`` ``[N, K]`` (all-zero rows get scale 0)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / MAX_CODE
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    codes = (w * inv[:, None]).round_().clamp_(-MAX_CODE, MAX_CODE).to(torch.int8)
    return Int8Weight(codes, scales)


def dequantize_int8(q: Int8Weight) -> torch.Tensor:
    """``[N, K]`` float32: ``code * scale``."""
    return q.codes.float() * q.scales[:, None]


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales_bf16: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` (any float dtype) times ``codes`` ``[N, K]`` int8 transposed, scaled by
    ``scales_bf16`` ``[N]``: ``[M, N]`` bfloat16. Shapes the packed kernel cannot take safely
    (:func:`can_use_packed_int8`) are computed with the same rounding on plain torch ops."""
    x16 = x.to(torch.bfloat16).contiguous()
    if can_use_packed_int8(codes.shape[1]):
        return torch._weight_int8pack_mm(x16, codes, scales_bf16)
    out = (x16.float() @ codes.float().t()) * scales_bf16.float()
    return out.to(torch.bfloat16)
