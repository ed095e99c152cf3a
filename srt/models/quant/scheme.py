"""What a checkpoint's ``quantization_config`` says, read into one frozen :class:`QuantScheme`.

Formats read (each as its public releases and writers lay it out on disk):

* ``fp8`` (Hugging Face / DeepSeek / Qwen3-FP8): ``weight`` float8_e4m3fn ``[out, in]`` with
  ``weight_scale_inv`` float32 ``[ceil(out/bn), ceil(in/bk)]`` when ``weight_block_size`` is
  ``[bn, bk]`` (activations quantised per token and per ``bk`` block), or ``weight_scale``
  float32 scalar (per tensor) with ``input_scale`` scalar when ``activation_scheme`` is
  ``static`` (AutoFP8);
* ``fbgemm_fp8``: ``weight`` e4m3 with ``weight_scale`` ``[out, 1]``, activations per token;
* ``awq`` (AutoAWQ GEMM): ``qweight`` int32 ``[in, out/8]`` (eight 4-bit columns per word in
  the order 0 2 4 6 1 3 5 7), ``qzeros`` int32 ``[in/g, out/8]`` alike, ``scales`` ``[in/g, out]``;
* ``gptq`` (AutoGPTQ, GPTQModel): ``qweight`` int32 ``[in/8, out]`` (eight rows per word),
  ``qzeros`` int32 ``[in/g, out/8]`` holding ``zero - 1`` (``checkpoint_format`` ``gptq``) or the
  zero (``gptq_v2``), ``scales`` ``[in/g, out]``, ``g_idx`` int32 ``[in]`` (act-order);
* ``compressed-tensors`` (llm-compressor): ``float-quantized`` (``weight`` e4m3, ``weight_scale``
  ``[out, 1]`` / ``[1]`` / ``[out/bn, in/bk]`` by strategy channel / tensor / block,
  ``input_scale`` ``[1]`` for static activations) and ``pack-quantized`` (``weight_packed`` int32
  ``[out, in/8]``, values stored as ``q + 8``, ``weight_scale`` ``[out, in/g]``, ``weight_shape``).

Anything else in a field these formats read is refused with a ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FP8_METHODS = ("fp8", "fbgemm_fp8")
INT4_METHODS = ("awq", "gptq")
CT_METHOD = "compressed-tensors"
METHODS = (*FP8_METHODS, *INT4_METHODS, CT_METHOD)
GROUP_SIZES = (32, 64, 128, -1)


@dataclass(frozen=True)
class QuantScheme:
    """One linear-layer format for the whole checkpoint.

    ``kind``: ``"fp8"`` (W8A8 e4m3) or ``"int4"`` (weight-only). ``layout``: the on-disk layout
    (``fp8``, ``ct_fp8``, ``awq``, ``gptq``, ``ct_pack``). FP8: ``weight_granularity`` is
    ``tensor``, ``channel`` or ``block`` (``block`` = ``(bn, bk)``); ``activations`` is
    ``token`` (dynamic per token), ``block`` (dynamic per token and ``bk`` block) or
    ``static`` (the checkpoint's ``input_scale``). int4: ``group_size`` (-1: one group per
    row), ``symmetric``, ``act_order`` (GPTQ ``g_idx``), ``zero_offset`` (1 for GPTQ v1's
    ``zero - 1``). ``ignore``: checkpoint module names (or ``re:`` patterns) kept dense.
    """

    method: str
    kind: str
    layout: str
    weight_granularity: str = "channel"
    block: tuple[int, int] | None = None
    activations: str = "token"
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False
    zero_offset: int = 0
    ignore: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """A short name for logs and ``/server_info``."""
        if self.kind == "fp8":
            w = f"block{self.block[0]}x{self.block[1]}" if self.block else self.weight_granularity
            return f"{self.method}:fp8-{w}-act-{self.activations}"
        sym = "sym" if self.symmetric else "asym"
        order = "-actorder" if self.act_order else ""
        return f"{self.method}:int4-g{self.group_size}-{sym}{order}"


def read_scheme(model_dir: str | Path) -> QuantScheme | None:
    """The scheme of ``config.json``'s ``quantization_config`` (or of a ``quantization_config``
    key-less folder's ``quantize_config.json``, as older GPTQ writers left it); None when the
    checkpoint is not quantised."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if qc is None and (model_dir / "quantize_config.json").is_file():
        qc = json.loads((model_dir / "quantize_config.json").read_text())
        qc.setdefault("quant_method", "gptq")
    if qc is None:
        return None
    return parse_scheme(qc)


def parse_scheme(qc: Any) -> QuantScheme:
    """``quantization_config`` (a dict) -> :class:`QuantScheme`; ValueError naming the field."""
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; supported: "
            f"{list(METHODS)}"
        )
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "fbgemm_fp8":
        return QuantScheme(
            method, "fp8", "fp8", "channel", ignore=_names(qc, "modules_to_not_convert")
        )
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    return _compressed_tensors(qc)


def _field(qc: dict, name: str, default: Any, allowed: tuple, prefix: str = "") -> Any:
    value = qc.get(name, default)
    if value is None:
        value = default
    if value not in allowed:
        raise ValueError(
            f"quantization_config.{prefix}{name} {value!r} is not supported; supported: "
            f"{list(allowed)}"
        )
    return value


def _names(qc: dict, key: str) -> tuple[str, ...]:
    value = qc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config.{key} must be a list of module names")
    return tuple(value)


def _block(value: Any, field: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 and v % 16 == 0 for v in value)
    ):
        raise ValueError(
            f"quantization_config.{field} must be two positive multiples of 16, got {value!r}"
        )
    return int(value[0]), int(value[1])


def _hf_fp8(qc: dict) -> QuantScheme:
    _field(qc, "fmt", "e4m3", ("e4m3",))
    scheme = _field(qc, "activation_scheme", "dynamic", ("dynamic", "static"))
    ignore = _names(qc, "modules_to_not_convert") + _names(qc, "ignored_layers")
    block = qc.get("weight_block_size")
    if block is not None:
        if scheme != "dynamic":
            raise ValueError(
                "quantization_config.activation_scheme must be dynamic with weight_block_size"
            )
        b = _block(block, "weight_block_size")
        return QuantScheme("fp8", "fp8", "fp8", "block", b, "block", ignore=ignore)
    acts = "static" if scheme == "static" else "token"
    return QuantScheme("fp8", "fp8", "fp8", "tensor", None, acts, ignore=ignore)


def _int4_common(qc: dict) -> tuple[int, int]:
    bits = _field(qc, "bits", None, (4,))
    group = _field(qc, "group_size", None, GROUP_SIZES)
    return bits, group


def _awq(qc: dict) -> QuantScheme:
    _int4_common(qc)
    _field(qc, "version", "gemm", ("gemm", "GEMM"))
    zero_point = _field(qc, "zero_point", True, (True, False))
    return QuantScheme(
        "awq",
        "int4",
        "awq",
        group_size=qc["group_size"],
        symmetric=not zero_point,
        ignore=_names(qc, "modules_to_not_convert"),
    )


def _gptq(qc: dict) -> QuantScheme:
    _int4_common(qc)
    desc_act = _field(qc, "desc_act", False, (True, False))
    sym = _field(qc, "sym", True, (True, False))
    fmt = _field(qc, "checkpoint_format", "gptq", ("gptq", "gptq_v2"))
    if qc.get("is_marlin_format"):
        raise ValueError("quantization_config.is_marlin_format true is not supported")
    return QuantScheme(
        "gptq",
        "int4",
        "gptq",
        group_size=qc["group_size"],
        symmetric=sym,
        act_order=desc_act,
        zero_offset=1 if fmt == "gptq" else 0,
        ignore=_names(qc, "modules_to_not_convert"),
    )


def _compressed_tensors(qc: dict) -> QuantScheme:
    fmt = _field(qc, "format", None, ("float-quantized", "naive-quantized", "pack-quantized"))
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise ValueError(
            f"quantization_config.quantization_status {status!r} is not supported "
            "(a compressed or frozen checkpoint was expected)"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(
            "quantization_config.config_groups must hold exactly one group "
            f"(got {len(groups) if isinstance(groups, dict) else type(groups).__name__})"
        )
    ((gname, group),) = groups.items()
    where = f"config_groups.{gname}."
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise ValueError(f"quantization_config.{where}targets {targets!r}: only ['Linear']")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ValueError(f"quantization_config.{where}weights must be an object")
    if group.get("output_activations") is not None:
        raise ValueError(f"quantization_config.{where}output_activations is not supported")
    ignore = _names(qc, "ignore")
    wtype = _field(w, "type", None, ("float", "int"), where + "weights.")
    if wtype == "float":
        _field(w, "num_bits", None, (8,), where + "weights.")
        strategy = _field(w, "strategy", None, ("tensor", "channel", "block"), where + "weights.")
        if w.get("dynamic"):
            raise ValueError(f"quantization_config.{where}weights.dynamic true is not supported")
        block = (
            _block(w.get("block_structure"), where + "weights.block_structure")
            if (strategy == "block")
            else None
        )
        acts = _ct_activations(group.get("input_activations"), where, block)
        return QuantScheme(CT_METHOD, "fp8", "ct_fp8", strategy, block, acts, ignore=ignore)
    if fmt != "pack-quantized":
        raise ValueError(
            f"quantization_config.format {fmt!r} with int weights is not supported "
            "(pack-quantized only)"
        )
    _field(w, "num_bits", None, (4,), where + "weights.")
    _field(w, "symmetric", True, (True,), where + "weights.")
    strategy = _field(w, "strategy", None, ("group", "channel"), where + "weights.")
    actorder = _field(w, "actorder", None, (None, False, "static"), where + "weights.")
    del actorder  # static act-order keeps groups contiguous on disk: nothing to undo
    if group.get("input_activations") is not None:
        raise ValueError(
            f"quantization_config.{where}input_activations must be null for int4 weights"
        )
    group_size = -1 if strategy == "channel" else w.get("group_size")
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"quantization_config.{where}weights.group_size {group_size!r} is not supported; "
            f"supported: {list(GROUP_SIZES)}"
        )
    return QuantScheme(CT_METHOD, "int4", "ct_pack", group_size=group_size, ignore=ignore)


def _ct_activations(acts: Any, where: str, block: tuple[int, int] | None) -> str:
    if acts is None:
        raise ValueError(
            f"quantization_config.{where}input_activations is null: FP8 weight-only is not "
            "supported (W8A8 only)"
        )
    _field(acts, "type", None, ("float",), where + "input_activations.")
    _field(acts, "num_bits", None, (8,), where + "input_activations.")
    strategy = acts.get("strategy")
    dynamic = acts.get("dynamic")
    if dynamic is True and strategy == "token":
        return "token"
    if dynamic is True and strategy == "group" and block and acts.get("group_size") == block[1]:
        return "block"
    if dynamic is False and strategy == "tensor":
        return "static"
    raise ValueError(
        f"quantization_config.{where}input_activations (strategy {strategy!r}, dynamic "
        f"{dynamic!r}) is not supported: dynamic per token, dynamic per group of the weight "
        "block, or static per tensor"
    )
