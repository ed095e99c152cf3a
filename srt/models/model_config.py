"""What the runtime needs to know about a checkpoint, read once from a Hugging Face folder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and options of a decoder-only model, from ``config.json`` (+ generation config).

    ``rope_theta`` and ``rope_scaling`` are normalised across transformers versions:
    ``rope_scaling`` is None for plain rope, else a dict holding at least ``rope_type``.
    """

    model_dir: Path
    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int  # max_position_embeddings
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(compare=False)
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    dtype: torch.dtype  # the checkpoint's dtype (float32 when the config does not say)
    hf_config: Any = field(compare=False, repr=False)  # transformers PretrainedConfig

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        from transformers import AutoConfig

        model_dir = Path(model_dir)
        config_file = model_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{model_dir} has no config.json: expected a Hugging Face model folder "
                "(config.json + *.safetensors)"
            )
        raw = json.loads(config_file.read_text())
        hf = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        architectures = getattr(hf, "architectures", None) or []
        if len(architectures) != 1:
            raise ValueError(
                f"{config_file}: expected exactly one entry in 'architectures', got {architectures}"
            )
        num_heads = hf.num_attention_heads
        rope_theta, rope_scaling = _rope_params(hf)
        return cls(
            model_dir=model_dir,
            architecture=architectures[0],
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            context_length=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            eos_token_ids=_eos_token_ids(model_dir, hf),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            dtype=_checkpoint_dtype(raw),
            hf_config=hf,
        )


def _rope_params(hf: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3): the global layers' rope
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(hf, "rope_theta", 10000.0))
        scaling = dict(getattr(hf, "rope_scaling", None) or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _eos_token_ids(model_dir: Path, hf: Any) -> tuple[int, ...]:
    ids = _as_id_list(getattr(hf, "eos_token_id", None))
    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        ids += _as_id_list(json.loads(gen_file.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))  # de-duplicated, order kept


def _checkpoint_dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if isinstance(name, str) and name.startswith("torch."):
        name = name[len("torch.") :]
    return _DTYPES.get(name, torch.float32)
