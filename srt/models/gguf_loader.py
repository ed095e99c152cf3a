"""Converts a GGUF file into a Hugging Face style folder the safetensors loader can read.

The folder gets ``config.json`` and ``generation_config.json`` built from the GGUF metadata,
``model.safetensors`` (or shards + index) holding the dequantized weights under Hugging Face
names, and the tokenizer files (with the chat template) that transformers builds from the GGUF.
Weights are stored in float32, so the converted model holds exactly the dequantized values
(the model loader casts them to the run dtype).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixlm.srt.models.gguf_file import GGUFFile, GGUFTensorInfo
from radixlm.srt.models.layers import rope_inv_freq

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3 long-context rope: llama.cpp keeps only the per-frequency divisors (rope_freqs.weight);
# every Llama 3.x release uses these band parameters with its own factor.
_LLAMA3_BANDS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_SHARD_BYTES = 4 << 30


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Writes the Hugging Face folder for ``gguf_path`` into ``out_dir`` (created) and returns it."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        meta = GGUFFile(gguf_path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    if meta.arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {meta.arch!r} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _hf_config(meta)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(_generation_config(meta), indent=2))
    _write_weights(meta, config, out_dir)
    _write_tokenizer(meta, out_dir)
    return out_dir


def _hf_config(meta: GGUFFile) -> dict[str, Any]:
    names = {t.name for t in meta.tensors}
    num_heads = int(meta.get("{arch}.attention.head_count"))
    hidden_size = int(meta.get("{arch}.embedding_length"))
    head_dim = int(meta.get("{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(meta.get("{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"{meta.path}: partial rotary embeddings ({rotary_dim} of {head_dim}) are not supported"
        )
    token_embd = meta.tensor("token_embd.weight")
    if token_embd is None:
        raise ValueError(f"{meta.path}: the GGUF file has no token_embd.weight tensor")
    theta = float(meta.get("{arch}.rope.freq_base", 10000.0))
    config = {
        "architectures": [GGUF_ARCHITECTURES[meta.arch]],
        "model_type": meta.arch,
        "vocab_size": token_embd.shape[0],
        "hidden_size": hidden_size,
        "intermediate_size": int(meta.get("{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.get("{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get("{arch}.context_length")),
        "rms_norm_eps": float(meta.get("{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(meta, head_dim, theta),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    config.update(_generation_config(meta))
    return config


def _rope_scaling(meta: GGUFFile, head_dim: int, theta: float) -> dict[str, Any] | None:
    kind = meta.get("{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.get("{arch}.rope.scaling.factor"))}
    if kind not in ("none", ""):
        raise ValueError(
            f"{meta.path}: rope scaling {kind!r} is not supported (none, linear, llama3)"
        )
    freqs = meta.tensor("rope_freqs.weight")
    if freqs is None:
        return None
    divisors = meta.dequantize(freqs).reshape(-1)
    if np.allclose(divisors, 1.0):
        return None
    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), **_LLAMA3_BANDS}
    expected = rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, scaling)
    if expected.shape != divisors.shape or not np.allclose(expected.numpy(), divisors, rtol=1e-3):
        raise ValueError(f"{meta.path}: rope_freqs.weight does not follow the Llama 3 rope scaling")
    return scaling


def _generation_config(meta: GGUFFile) -> dict[str, Any]:
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    out: dict[str, Any] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    if bos is not None:
        out["bos_token_id"] = int(bos)
    if eos_ids:
        out["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return out


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for tensors with no HF counterpart)."""
    base, _, kind = gguf_name.rpartition(".")  # kind: weight / bias
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}.{kind}"
    return None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of q/k rows (it interleaves each head's two rope halves)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensor(meta: GGUFFile, info: GGUFTensorInfo, config: dict[str, Any]) -> torch.Tensor:
    w = meta.dequantize(info)
    if meta.arch == "llama" and ".attn_q." in info.name:
        w = unpermute_rows(w, config["num_attention_heads"])
    elif meta.arch == "llama" and ".attn_k." in info.name:
        w = unpermute_rows(w, config["num_key_value_heads"])
    return torch.from_numpy(np.ascontiguousarray(w))


def _write_weights(meta: GGUFFile, config: dict[str, Any], out_dir: Path) -> None:
    """Dequantizes tensor by tensor into shards of about ``_SHARD_BYTES`` (+ index if several)."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    shard_bytes, weight_map, file_names = 0, {}, []

    def flush() -> None:
        file_names.append(f"model-{len(file_names) + 1:05d}.safetensors")
        save_file(shard, str(out_dir / file_names[-1]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_names[-1]))
        shard.clear()

    for tensor in meta.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            if tensor.name != "rope_freqs.weight":
                logger.warning(
                    "%s: skipping GGUF tensor %s (no counterpart)", meta.path, tensor.name
                )
            continue
        if shard_bytes >= _SHARD_BYTES:
            flush()
            shard_bytes = 0
        shard[name] = _hf_tensor(meta, tensor, config)
        shard_bytes += shard[name].numel() * shard[name].element_size()
    flush()
    if len(file_names) == 1:
        (out_dir / file_names[0]).rename(out_dir / "model.safetensors")
        return
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(meta: GGUFFile, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model", None) is None:
        logger.warning(
            "%s has no tokenizer metadata; the converted folder has no tokenizer", meta.path
        )
        return
    # the tokenizer class itself: AutoTokenizer would first re-read the whole file for a config
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        str(meta.path.parent), gguf_file=meta.path.name
    )
    template = meta.get("tokenizer.chat_template", None)
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
