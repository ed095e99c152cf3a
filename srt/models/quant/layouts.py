"""On-disk tensors of each quantised layout -> one running layout per kind.

Every checkpoint tensor of a quantised projection is described by :class:`RawTensor`: which of
its dims runs along the projection's output features and which along its input features, and
how many features one stored item covers there (8 for a packed int32, the group size for
scales, 1 for plain values; ``None``: the dim is kept whole on every rank). The loader
(``linear.py``) takes this rank's rows and columns with it, so tensor parallelism and merged
projections (q/k/v, gate/up) work the same for every format.

Running layouts (what the kernels of ``kernels/quant_gemm.py`` read):

* FP8: ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale`` float32 ``[out, kb]``: one
  scale per output row and per ``block_k`` input features (``kb = ceil(in / block_k)``; per
  tensor and per channel have ``kb = 1``). Per-tensor scales of merged q/k/v become the rows of
  their part, and 128x128 block scales are repeated over their block's rows, so a rank's rows
  need no alignment to a block (3% more scale bytes than the weight's at 128).
* int4: ``qweight`` int32 ``[out, in / 8]``, eight input features per word (feature ``8 c + i``
  in bits ``4 i .. 4 i + 3``, values 0..15); ``scales`` and ``zeros`` ``[out, in / group]`` in the
  model dtype: ``w = (q - zero) * scale``; ``perm`` int64 ``[in]`` for GPTQ act-order (the
  columns are stored sorted by group, the activations are gathered with ``perm``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.quant_gemm import FP8_DTYPE

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of each nibble in AutoAWQ's GEMM packing


@dataclass(frozen=True)
class RawTensor:
    """Layout of one checkpoint tensor relative to the projection ``[out, in]``."""

    out_dim: int | None
    out_div: int | str | None
    in_dim: int | None
    in_div: int | str | None  # "g": the group size (kept whole when the scheme has one group)
    dtype: tuple[torch.dtype, ...] | None = None


def raw_tensors(layout: str, scheme) -> dict[str, RawTensor]:
    """The checkpoint suffixes of one projection (``qweight``, ``scales``, ...) and their layout."""
    i32 = (torch.int32,)
    fp8 = (FP8_DTYPE,)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if layout in ("fp8", "ct_fp8"):
        out = {"weight": RawTensor(0, 1, 1, 1, fp8)}
        scale_name = "weight_scale_inv" if layout == "fp8" and scheme.block else "weight_scale"
        if scheme.weight_granularity == "channel":
            out[scale_name] = RawTensor(0, 1, None, None, floats)
        else:  # per tensor (a scalar per part) and blocks: read whole, expanded in canonical
            out[scale_name] = RawTensor(None, None, None, None, floats)
        if scheme.activations == "static":
            out["input_scale"] = RawTensor(None, None, None, None, floats)
        return out
    g = "g" if scheme.group_size != -1 else None
    if layout == "awq":
        out = {
            "qweight": RawTensor(1, 8, 0, 1, i32),
            "scales": RawTensor(1, 1, 0, g, floats),
        }
        if not scheme.symmetric:
            out["qzeros"] = RawTensor(1, 8, 0, g, i32)
        return out
    if layout == "gptq":
        sg = None if scheme.act_order else g  # act-order: groups are spread over the inputs
        return {
            "qweight": RawTensor(1, 1, 0, 8, i32),
            "qzeros": RawTensor(1, 8, 0, sg, i32),
            "scales": RawTensor(1, 1, 0, sg, floats),
            "g_idx": RawTensor(None, None, 0, 1, i32),
        }
    if layout == "ct_pack":
        return {
            "weight_packed": RawTensor(0, 1, 1, 8, i32),
            "weight_scale": RawTensor(0, 1, 1, g, floats),
            "weight_shape": RawTensor(None, None, None, None, (torch.int64, torch.int32)),
        }
    raise ValueError(f"unknown quantised layout {layout!r}")
