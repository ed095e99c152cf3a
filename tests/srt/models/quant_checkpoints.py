"""Tiny random Llama checkpoints written in each quantised on-disk format, with the dense
checkpoint of their dequantised weights (the reference).

Tensor names, dtypes, shapes and ``quantization_config`` follow what the public writers save:
Hugging Face ``fp8`` (block scales as in Qwen3-*-FP8 / DeepSeek-V3: ``weight_scale_inv``; per
tensor as AutoFP8: scalar ``weight_scale`` and ``input_scale``), AutoAWQ GEMM, AutoGPTQ /
GPTQModel v1 (``qzeros`` hold ``zero - 1``), fbgemm FP8 (Llama-3.1-405B-FP8: ``weight_scale``
``[out, 1]``), and llm-compressor's compressed-tensors
``float-quantized`` and ``pack-quantized``. The packing here is written independently of the
loader (plain loops over nibbles), so a mistake in one does not cancel in the other.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_checkpoints import hf_config, random_hf_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# hidden 256 (4 heads of 64, 2 KV heads: k/v 128 rows), MLP 512: every group size (32, 64,
# 128) and 128x128 block divides every projection, and still does at TP=2 (but k/v rows)
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8 = torch.float8_e4m3fn

CT_WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "dynamic": False,
    "group_size": None,
    "block_structure": None,
    "observer": "minmax",
    "actorder": None,
}


def _ct_config(fmt: str, weights: dict, inputs: dict | None) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "version": "0.12.2",
    }


# name -> quantization_config
FORMATS: dict[str, dict] = {
    "fp8_block": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": None,
    },
    "fp8_tensor_static": {"quant_method": "fp8", "activation_scheme": "static"},
    "fbgemm_fp8_channel": {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["lm_head"],
    },
    "ct_fp8_channel": _ct_config(
        "float-quantized",
        {**CT_WEIGHTS, "strategy": "channel"},
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "token",
            "symmetric": True,
            "dynamic": True,
            "observer": None,
        },
    ),
    "ct_fp8_block": _ct_config(
        "float-quantized",
        {**CT_WEIGHTS, "strategy": "block", "block_structure": [128, 128]},
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "group",
            "group_size": 128,
            "symmetric": True,
            "dynamic": True,
            "observer": None,
        },
    ),
    "ct_fp8_tensor_static": _ct_config(
        "naive-quantized",
        {**CT_WEIGHTS, "strategy": "tensor"},
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor",
            "symmetric": True,
            "dynamic": False,
            "observer": "minmax",
        },
    ),
    "awq_g128": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    },
    "awq_g32": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
    },
    "gptq_g128_sym": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "checkpoint_format": "gptq",
    },
    "gptq_g64_asym": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 64,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq",
    },
    "gptq_g32_actorder": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": True,
        "sym": True,
        "checkpoint_format": "gptq",
    },
    "gptq_channel_v2": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": -1,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq_v2",
    },
    "ct_int4_g128": _ct_config(
        "pack-quantized",
        {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "dynamic": False,
            "strategy": "group",
            "group_size": 128,
            "block_structure": None,
            "observer": "minmax",
            "actorder": None,
        },
        None,
    ),
    "ct_int4_channel": _ct_config(
        "pack-quantized",
        {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "dynamic": False,
            "strategy": "channel",
            "group_size": None,
            "observer": "minmax",
            "actorder": None,
        },
        None,
    ),
}
FP8_FORMATS = sorted(n for n in FORMATS if "fp8" in n)
INT4_FORMATS = sorted(n for n in FORMATS if n not in FP8_FORMATS)
INPUT_SCALE = 6.0 / 448  # static activation scale: |x| up to 6 represented


def _pack(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """values 0..15 [R, C] -> int32 [R, C/8], nibble i of word c = column 8c + order[i]."""
    r, c = values.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for i in range(8):
        words |= values.long()[:, [8 * w + order[i] for w in range(c // 8)]] << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _int4_groups(w: torch.Tensor, group: int, sym: bool, cols=None, scale_dtype=torch.float16):
    """Quantises ``w`` [out, in] in groups of input features -> (q 0..15 [out, in],
    scales [out, G], zeros [out, G] ints, group of each input feature [in])."""
    out_f, in_f = w.shape
    g = in_f if group == -1 else group
    order = torch.arange(in_f) if cols is None else cols  # act-order: the features by group
    group_of = torch.empty(in_f, dtype=torch.long)
    group_of[order] = torch.arange(in_f) // g
    n = in_f // g
    scales = torch.empty(out_f, n)
    zeros = torch.empty(out_f, n)
    q = torch.empty(out_f, in_f)
    for j in range(n):
        idx = order[j * g : (j + 1) * g]
        blk = w[:, idx]
        if sym:
            s = (blk.abs().amax(1) / 7).clamp_min(1e-6)
            z = torch.full_like(s, 8)
        else:
            lo, hi = blk.amin(1).clamp(max=0), blk.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-6)
            z = (-lo / s).round().clamp(0, 15)
        s = s.to(scale_dtype).float()  # the stored scale
        q[:, idx] = (blk / s[:, None]).round().add(z[:, None]).clamp(0, 15)
        scales[:, j], zeros[:, j] = s, z
    return q.to(torch.uint8), scales, zeros, group_of


def _fp8(w: torch.Tensor, scale_rows: torch.Tensor) -> torch.Tensor:
    return (w / scale_rows).clamp(-448, 448).to(FP8)


def quantise_linear(fmt: str, name: str, w: torch.Tensor, gen: torch.Generator):
    """Tensors for checkpoint prefix ``name`` (``...q_proj``) and the dequantised weight."""
    qc = FORMATS[fmt]
    out_f, in_f = w.shape
    t: dict[str, torch.Tensor] = {}
    if fmt in ("fp8_block", "ct_fp8_block"):
        b = 128
        blocks = w.unflatten(0, (-1, b)).unflatten(2, (-1, b))  # [ob, b, ib, b]
        s = (blocks.abs().amax(dim=(1, 3)) / 448).float()  # [ob, ib]
        full = s.repeat_interleave(b, 0).repeat_interleave(b, 1)
        w8 = _fp8(w, full)
        t[f"{name}.weight"] = w8
        t[f"{name}.weight_scale_inv" if fmt == "fp8_block" else f"{name}.weight_scale"] = s
        return t, w8.float() * full
    if fmt in ("ct_fp8_channel", "fbgemm_fp8_channel"):
        s = (w.abs().amax(1, keepdim=True) / 448).float()
        w8 = _fp8(w, s)
        t[f"{name}.weight"], t[f"{name}.weight_scale"] = w8, s
        return t, w8.float() * s
    if fmt in ("fp8_tensor_static", "ct_fp8_tensor_static"):
        s = (w.abs().amax() / 448).float()
        w8 = _fp8(w, s)
        scalar = fmt == "fp8_tensor_static"  # AutoFP8: shape []; compressed-tensors: [1]
        t[f"{name}.weight"] = w8
        t[f"{name}.weight_scale"] = s.reshape(()) if scalar else s.reshape(1)
        inp = torch.tensor(INPUT_SCALE * (1 + 0.1 * torch.rand((), generator=gen).item()))
        t[f"{name}.input_scale"] = inp.reshape(()) if scalar else inp.reshape(1)
        return t, w8.float() * s
    group = qc.get("group_size", -1)
    if fmt.startswith("ct_int4"):
        group = -1 if "channel" in fmt else qc["config_groups"]["group_0"]["weights"]["group_size"]
        q, s, z, group_of = _int4_groups(w, group, sym=True, scale_dtype=torch.bfloat16)
        t[f"{name}.weight_packed"] = _pack(q)  # [out, in/8], q + 8 stored
        t[f"{name}.weight_scale"] = s.to(torch.bfloat16)
        t[f"{name}.weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int64)
    elif fmt.startswith("awq"):
        q, s, z, group_of = _int4_groups(w, group, sym=False)
        t[f"{name}.qweight"] = _pack(q.t().contiguous(), AWQ_ORDER)  # [in, out/8]
        t[f"{name}.qzeros"] = _pack(z.t().contiguous().to(torch.uint8), AWQ_ORDER)
        t[f"{name}.scales"] = s.t().contiguous().half()
    else:
        # act-order: the inputs by decreasing Hessian diagonal, shared by the projections
        # of one input (q/k/v, gate/up), as GPTQ orders them
        layer = name.split(".layers.")[1].split(".")[0]
        reader = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
        proj = name.rsplit(".", 1)[-1]
        key = f"{layer}.{reader.get(proj, proj)}"
        order_gen = torch.Generator().manual_seed(sum(map(ord, key)) * 7919)
        cols = torch.randperm(in_f, generator=order_gen) if qc["desc_act"] else None
        q, s, z, group_of = _int4_groups(w, group, sym=qc["sym"], cols=cols)
        t[f"{name}.qweight"] = _pack_rows(q.t().contiguous())  # [in/8, out]
        stored = z - (1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0)
        t[f"{name}.qzeros"] = _pack(stored.t().contiguous().to(torch.uint8))  # [G, out/8]
        t[f"{name}.scales"] = s.t().contiguous().half()
        t[f"{name}.g_idx"] = group_of.to(torch.int32)
    deq = (q.float() - z[:, group_of]) * s[:, group_of]
    return t, deq


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: values [in, out] -> int32 [in/8, out], nibble i of row r = input 8r+i."""
    return _pack(values.t().contiguous()).t().contiguous()


def write_quantised(fmt: str, folder: Path, ref_folder: Path, seed: int = 0, **overrides):
    """Writes the quantised checkpoint of a random Llama into ``folder`` and the dense
    checkpoint of its dequantised weights into ``ref_folder``."""
    config = hf_config("llama", **{**SIZES, **overrides})
    model = random_hf_model(config, seed)
    model.save_pretrained(ref_folder)  # config, generation config; weights replaced below
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    quantised, dense = {}, {}
    for name, tensor in state.items():
        prefix = name[: -len(".weight")]
        if prefix.rsplit(".", 1)[-1] in LINEARS and name.endswith(".weight"):
            tensors, deq = quantise_linear(fmt, prefix, tensor, gen)
            quantised.update(tensors)
            dense[name] = deq.contiguous()
        else:
            quantised[name] = tensor
            dense[name] = tensor
    for f in ref_folder.glob("*.safetensors"):
        f.unlink()
    save_file(dense, str(ref_folder / "model.safetensors"), metadata={"format": "pt"})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(quantised, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ref_folder / "config.json").read_text())
    cfg["quantization_config"] = FORMATS[fmt]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in ref_folder.glob("*.json"):
        if extra.name != "config.json":
            (folder / extra.name).write_text(extra.read_text())
    return folder, ref_folder
