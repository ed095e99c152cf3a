"""Quantised linear layers: the one place a model's ``Linear`` modules become FP8 or int4.

:func:`prepare_model` runs after the model is built and before its weights load: every
``Linear`` the scheme covers loses its dense ``weight`` and gets one placeholder parameter per
checkpoint suffix of the format (``qweight``, ``scales``, ``weight_scale_inv``, ...), whose
``weight_loader`` keeps this rank's slice of each part (q/k/v, gate/up) as it arrives
(``layouts.RawTensor`` says which dims to cut). The model's own ``load_weights`` and
``WeightMap`` route the tensors, as for dense checkpoints. :func:`finalize_model` then turns
each layer's parts into the running layout (``layouts.py``), registers it as the layer's
parameters and sets the layer's ``forward`` (instance-level, as ``quantize.py`` does; the
weight-streaming decoder path sees it and stays off).

Forward: ``kernels.quant_gemm`` (``torch._scaled_mm`` / Triton on CUDA, dequantise-then-matmul
elsewhere). On a CPU the dequantised weight is cached in the model dtype at load (CPU models
are small; the cache costs the dense model's bytes again); on a GPU nothing dense is kept.
Inside :func:`reference_weights` every layer computes ``x @ dequantised(W)^T`` in float32
instead (no activation quantisation): the reference of the accuracy check.

``quantize_model_fp8`` (``--quantization fp8``) gives a loaded dense model the same FP8 layers:
per-channel weight scales, activations per token.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import quant_gemm
from radixlm.kernels.quant_gemm import (
    FP8_DTYPE,
    FP8_MAX,
    SEQUENTIAL,
    dequantize_fp8,
    dequantize_int4,
    pack_int4,
    unpack_int4,
)
from radixlm.srt.models.layers import Linear
from radixlm.srt.models.quant.layouts import AWQ_ORDER, RawTensor, raw_tensors
from radixlm.srt.models.quant.scheme import QuantScheme
from radixlm.srt.models.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    shape_of,
    take,
)

logger = logging.getLogger(__name__)

HOST_SUFFIXES = frozenset({"weight_shape", "g_idx"})
MERGED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _is_ignored(name: str, scheme: QuantScheme) -> bool:
    """Whether module ``name`` (ours: merged names) is one the checkpoint keeps dense."""
    leaf = name.rsplit(".", 1)[-1]
    candidates = [name] + [name[: -len(leaf)] + p for p in MERGED_PARTS.get(leaf, ())]
    for entry in scheme.ignore:
        if entry.startswith("re:"):
            if any(re.fullmatch(entry[3:], c) for c in candidates):
                return True
        elif entry in candidates or any(c.endswith("." + entry) for c in candidates):
            return True
    return False


def _out_parts(module: Linear) -> list[tuple[int, int, int]]:
    """``(full out features, start, length)`` of each checkpoint part of the layer's rows."""
    if isinstance(module, ColumnParallelLinear):
        return [(full, s, n) for full, (s, n) in zip(module.full_sizes, module.ranges, strict=True)]
    sizes = getattr(module, "output_sizes", [module.out_features])
    return [(n, 0, n) for n in sizes]


def _in_range(module: Linear) -> tuple[int, int, int]:
    """``(full in features, start, length)`` of the layer's input columns."""
    if isinstance(module, RowParallelLinear):
        return (module.in_full, *module.in_range)
    return module.in_features, 0, module.in_features


def _part_index(module: Linear, shard_id: Any) -> int:
    if shard_id is None:
        return 0
    shards = getattr(module, "SHARDS", None)
    return shards.index(shard_id) if isinstance(shard_id, str) and shards else int(shard_id)


def _div(div: int | str | None, scheme: QuantScheme) -> int | None:
    return scheme.group_size if div == "g" else div


def _cut(loaded: Any, dim: int | None, div: Any, full: int, start: int, n: int, what: str):
    """This rank's items of ``loaded`` along ``dim`` (``div`` features per item)."""
    if dim is None or div is None or n == full:
        return loaded
    if start % div or n % div:
        raise ValueError(
            f"{what}: this rank's features [{start}, {start + n}) do not fall on the format's "
            f"items of {div} features (choose a tp_size that splits the layer on them)"
        )
    return take(loaded, dim, start // div, n // div)


def _load_raw(module: Linear, suffix: str, param: nn.Parameter, loaded: Any, shard_id=None):
    scheme: QuantScheme = module.quant_scheme
    spec: RawTensor = module.quant_specs[suffix]
    part = _part_index(module, shard_id)
    full_out, out_start, out_n = _out_parts(module)[part]
    in_full, in_start, in_n = _in_range(module)
    what = f"{suffix} of part {shard_id}" if shard_id is not None else suffix
    shape = shape_of(loaded)
    if spec.out_dim is not None:
        od = _div(spec.out_div, scheme)
        want = -(-full_out // od) if od else None
        if want is not None and shape[spec.out_dim] != want:
            raise ValueError(f"{what} has shape {shape}: dim {spec.out_dim} should be {want}")
    if spec.in_dim is not None:
        idv = _div(spec.in_div, scheme)
        want = -(-in_full // idv) if idv else (1 if spec.in_div == "g" else None)
        if want is not None and shape[spec.in_dim] != want:
            raise ValueError(f"{what} has shape {shape}: dim {spec.in_dim} should be {want}")
    t = _cut(loaded, spec.out_dim, _div(spec.out_div, scheme), full_out, out_start, out_n, what)
    t = _cut(t, spec.in_dim, _div(spec.in_div, scheme), in_full, in_start, in_n, what)
    if not isinstance(t, torch.Tensor):  # a lazy safetensors slice: read it (0-d: [...])
        t = t[...] if not shape else t[:]
    if spec.dtype is not None and t.dtype not in spec.dtype:
        raise ValueError(f"{what} has dtype {t.dtype}; the format stores {list(spec.dtype)}")
    # on the layer's device now (the checkpoint's tensors arrive on the CPU): the conversion in
    # finalize_model runs there, and nothing of a GPU model stays on the CPU. Small metadata
    # read on the host (shapes, act-order's group of each feature) stays there.
    device = "cpu" if suffix in HOST_SUFFIXES else module.quant_device
    module.quant_raw.setdefault(suffix, {})[part] = t.to(device, copy=True)


@torch.inference_mode()
def prepare_model(model: nn.Module, scheme: QuantScheme) -> int:
    """Gives every covered ``Linear`` the placeholders of ``scheme``'s format (see the module
    docstring); returns how many layers were prepared."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or _is_ignored(name, scheme):
            continue
        device = module.weight.device
        del module._parameters["weight"]
        module.quant_scheme = scheme
        module.quant_device = device
        module.quant_specs = raw_tensors(scheme.layout, scheme)
        module.quant_raw = {}
        for suffix in module.quant_specs:
            p = nn.Parameter(torch.empty(0, device=device), requires_grad=False)
            p.weight_loader = functools.partial(_load_raw, module, suffix)
            module.register_parameter(suffix, p)
        count += 1
    if not count:
        raise ValueError("quantization_config covers no linear layer of this model")
    return count


@torch.inference_mode()
def finalize_model(model: nn.Module, scheme: QuantScheme, dtype: torch.dtype) -> None:
    """Turns every prepared layer's loaded parts into its running layout."""
    for module in model.modules():
        if getattr(module, "quant_raw", None) is None:
            continue
        parts = _out_parts(module)
        for suffix in module.quant_specs:
            module._parameters.pop(suffix)
        raw, module.quant_raw = module.quant_raw, None
        if scheme.kind == "fp8":
            _finalize_fp8(module, scheme, raw, parts)
        else:
            _finalize_int4(module, scheme, raw, parts, dtype)
        install(module)
    model.quant_scheme = scheme
    _release_cached_memory(model)


def _release_cached_memory(model: nn.Module) -> None:
    """Gives the freed dense and raw tensors back to the device, so that the KV pool, sized from
    the free memory, gets them."""
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()


def _register(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """``value`` as the layer's parameter ``name``, on the layer's device (``quant_device``)."""
    if value is None:
        setattr(module, name, None)
        return
    device = getattr(module, "quant_device", value.device)
    module.register_parameter(name, nn.Parameter(value.to(device), requires_grad=False))


def _finalize_fp8(module, scheme: QuantScheme, raw: dict, parts: list) -> None:
    in_full, in_start, in_n = _in_range(module)
    weights, scales = [], []
    scale_name = "weight_scale_inv" if "weight_scale_inv" in raw else "weight_scale"
    block_k = scheme.block[1] if scheme.block else None
    for index, (full_out, out_start, out_n) in enumerate(parts):
        w = raw["weight"][index]
        s = raw[scale_name][index].float()
        if scheme.weight_granularity == "tensor":
            if s.numel() != 1:
                raise ValueError(f"{scale_name} has {s.numel()} values; per tensor wants one")
            s = s.reshape(1, 1).expand(out_n, 1)
        elif scheme.weight_granularity == "channel":
            s = s.reshape(out_n, 1)
        else:
            bn, bk = scheme.block
            want = (-(-full_out // bn), -(-in_full // bk))
            if tuple(s.shape) != want:
                raise ValueError(f"{scale_name} has shape {tuple(s.shape)}, expected {want}")
            if in_start % bk:
                raise ValueError(
                    f"{scale_name}: this rank's input features start at {in_start}, not on a "
                    f"block of {bk} (choose a tp_size that splits the layer on blocks)"
                )
            s = s.repeat_interleave(bn, dim=0)[out_start : out_start + out_n]
            s = s[:, in_start // bk : -(-(in_start + in_n) // bk)]
        weights.append(w)
        scales.append(s.contiguous())
    _register(module, "weight", torch.cat(weights).contiguous())
    _register(module, "weight_scale", torch.cat(scales).contiguous())
    input_scale = None
    if scheme.activations == "static":  # one scale for the merged input: the parts' largest
        input_scale = torch.stack([t.float().reshape(()) for t in raw["input_scale"].values()])
        input_scale = input_scale.max().reshape(1)
    _register(module, "input_scale", input_scale)
    module.quant_kind, module.quant_block_k = "fp8", block_k
    module.quant_activations = scheme.activations


def _int4_part(scheme: QuantScheme, raw: dict, index: int):
    """One part -> (values uint8 [out, in], scales [out, groups], zeros [out, groups] float,
    g_idx [in] or None), in the checkpoint's column order."""
    if scheme.layout == "awq":
        q = unpack_int4(raw["qweight"][index], 1, AWQ_ORDER).t()
        s = raw["scales"][index].t()
        if scheme.symmetric:
            z = torch.full_like(s, 8, dtype=torch.float32)
        else:
            z = unpack_int4(raw["qzeros"][index], 1, AWQ_ORDER).t().float()
        return q, s, z, None
    if scheme.layout == "gptq":
        q = unpack_int4(raw["qweight"][index], 0, SEQUENTIAL).t()
        s = raw["scales"][index].t()
        z = unpack_int4(raw["qzeros"][index], 1, SEQUENTIAL).t().float() + scheme.zero_offset
        g_idx = raw["g_idx"][index].long() if scheme.act_order else None
        return q, s, z, g_idx
    q = unpack_int4(raw["weight_packed"][index], 1, SEQUENTIAL)
    s = raw["weight_scale"][index]
    return q, s, torch.full_like(s, 8, dtype=torch.float32), None


def _finalize_int4(module, scheme: QuantScheme, raw: dict, parts: list, dtype) -> None:
    in_full = _in_range(module)[0]
    if scheme.layout == "ct_pack":
        for index, (full_out, _, _) in enumerate(parts):
            shape = [int(v) for v in raw["weight_shape"][index].reshape(-1)]
            if shape != [full_out, in_full]:
                raise ValueError(f"weight_shape is {shape}, expected {[full_out, in_full]}")
    qs, ss, zs, perm = [], [], [], None
    for index in range(len(parts)):
        q, s, z, g_idx = _int4_part(scheme, raw, index)
        if g_idx is not None:
            q, s, z, part_perm = _sort_groups(q, s, z, g_idx, scheme.group_size)
            if perm is not None and not torch.equal(perm, part_perm):
                raise ValueError("g_idx differs between the parts of a merged projection")
            perm = part_perm
        if q.shape[1] % s.shape[1]:
            raise ValueError(f"{q.shape[1]} input features do not split into {s.shape[1]} groups")
        qs.append(q)
        ss.append(s.to(dtype))
        zs.append(z.to(dtype))
    _register(module, "qweight", pack_int4(torch.cat(qs), 1).contiguous())
    _register(module, "scales", torch.cat(ss).contiguous())
    _register(module, "zeros", torch.cat(zs).contiguous())
    if perm is not None and torch.equal(perm, torch.arange(len(perm))):
        perm = None  # g_idx in order: nothing to gather
    module.register_buffer("perm", None if perm is None else perm.to(module.quant_device))
    module.quant_kind = "int4"


def _sort_groups(q, s, z, g_idx: torch.Tensor, group_size: int):
    """GPTQ act-order: this rank's columns sorted by group; each group present must hold the
    same number of columns (true for GPTQ's g_idx at one rank)."""
    perm = torch.argsort(g_idx, stable=True)
    groups, counts = torch.unique_consecutive(g_idx[perm], return_counts=True)
    if (counts != counts[0]).any():
        raise ValueError(
            "g_idx: the groups of this rank's input features are not of equal size "
            "(act-order with this tp_size is not supported)"
        )
    return q[:, perm], s[:, groups], z[:, groups], perm


# --- forward ------------------------------------------------------------------------------


def install(module: Linear) -> None:
    """Sets the layer's forward to the quantised one; on a CPU (only) also the dense cache."""
    module.quant_reference = False
    module.quant_dense = None
    if uses_dense_cache(module):
        module.quant_dense = dense_weight(
            module, module.scales.dtype if module.quant_kind == "int4" else torch.float32
        )
    module.forward = functools.partial(_forward, module)


def uses_dense_cache(module: Linear) -> bool:
    """Whether the layer keeps a dequantised copy: only when its quantised weight and the
    layer's device are both the CPU (a GPU layer runs the kernels on its packed weight)."""
    weight = module.qweight if module.quant_kind == "int4" else module.weight
    device = getattr(module, "quant_device", weight.device)
    return weight.device.type == "cpu" and torch.device(device).type == "cpu"


def dense_weight(module: Linear, dtype: torch.dtype) -> torch.Tensor:
    """The layer's dequantised ``[out, in]`` weight in ``dtype``."""
    if module.quant_kind == "int4":
        return dequantize_int4(module.qweight, module.scales, module.zeros, module.perm, dtype)
    return dequantize_fp8(module.weight, module.weight_scale, dtype, module.quant_block_k)


def _forward(module: Linear, x: torch.Tensor) -> torch.Tensor:
    if module.quant_reference:
        y = F.linear(x.float(), dense_weight(module, torch.float32)).to(x.dtype)
    elif module.quant_kind == "int4":
        y = quant_gemm.int4_linear(
            x, module.qweight, module.scales, module.zeros, module.perm, module.quant_dense
        )
    else:
        y = quant_gemm.fp8_linear(
            x,
            module.weight,
            module.weight_scale,
            module.quant_activations,
            module.quant_block_k,
            module.input_scale,
            module.quant_dense,
        )
    tp = getattr(module, "tp", None)
    if isinstance(module, RowParallelLinear) and tp is not None and tp.size > 1:
        y = tp.all_reduce(y)
    return y if module.bias is None else y + module.bias


@contextlib.contextmanager
def reference_weights(model: nn.Module) -> Iterator[None]:
    """Inside the block every quantised layer multiplies by its dequantised weight in float32,
    activations unquantised (the accuracy check's reference)."""
    layers = [m for m in model.modules() if hasattr(m, "quant_reference")]
    for m in layers:
        m.quant_reference = True
    try:
        yield
    finally:
        for m in layers:
            m.quant_reference = False


@torch.inference_mode()
def quantize_model_fp8(model: nn.Module) -> int:
    """``--quantization fp8``: every ``Linear`` of a loaded dense model -> FP8 e4m3 weights with
    one scale per output row (amax / 448), activations quantised per token at run time."""
    scheme = QuantScheme("fp8-at-load", "fp8", "fp8", "channel", None, "token")
    count = 0
    for module in model.modules():
        if not isinstance(module, Linear) or "weight" not in module._parameters:
            continue
        w = module._parameters.pop("weight").data.float()
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        w8 = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        del w
        _register(module, "weight", w8)
        _register(module, "weight_scale", scale.contiguous())
        _register(module, "input_scale", None)
        module.quant_kind, module.quant_block_k, module.quant_activations = "fp8", None, "token"
        install(module)
        count += 1
    model.quant_scheme = scheme
    _release_cached_memory(model)
    return count
