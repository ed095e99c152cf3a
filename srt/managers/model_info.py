"""What both front ends report about the served model: its name in the API and SGLang's
``/get_model_info`` (the HTTP route and ``Engine.get_model_info``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixlm.srt.config import ServerConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(cfg: ServerConfig, info: dict[str, Any]) -> str:
    if cfg.served_model_name:
        return cfg.served_model_name
    if info.get("served_model_name"):
        return str(info["served_model_name"])
    if cfg.model_path is None:
        return DEFAULT_MODEL_NAME
    path = Path(cfg.model_path.rstrip("/"))
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def model_info_of(
    info: dict[str, Any], tokenizer_path: str | None, served_model_name: str
) -> dict[str, Any]:
    """SGLang's ``/get_model_info`` from the scheduler's ready report."""
    return {
        "model_path": info.get("model_path"),
        "tokenizer_path": tokenizer_path or info.get("model_path"),
        "served_model_name": served_model_name,
        "is_generation": True,
        "architecture": info.get("architecture"),
        "architectures": [info["architecture"]] if info.get("architecture") else [],
        "context_length": info.get("context_length"),
        "vocab_size": info.get("vocab_size"),
        "preferred_sampling_params": None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }
