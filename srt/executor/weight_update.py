"""New weights for the running model, read from disk in place (SGLang's
``update_weights_from_disk``): the same architecture and sizes, another checkpoint (a training
step, a fine-tune). The parameters are overwritten where they are, so CUDA graphs, the KV pool
and the attention backend stay valid; the caller empties the prefix cache (its KV was computed
with the old weights). A load that fails part-way restores the previous weights, so the model
is never left half one checkpoint and half another.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixlm.srt.models.default_model import resolve_model_path
from radixlm.srt.models.loader import init_dummy_weights, iter_safetensors, safetensors_files
from radixlm.srt.models.model_config import ModelConfig

if TYPE_CHECKING:
    from radixlm.srt.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# what the built model depends on: a checkpoint differing in any of these needs a new server
SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "context_length",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
)
LOAD_FORMATS = (None, "auto", "safetensors")


def _checkpoint(runner: ModelRunner, model_path: str, load_format: str | None) -> Path:
    """The folder to read, once everything that can be checked before writing is checked."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be auto or safetensors, got {load_format!r}")
    if runner.tp.is_distributed:
        raise ValueError("updating weights is not supported with tensor parallelism yet")
    if runner.cfg.quantization != "none":
        raise ValueError(
            f"updating weights is not supported with --quantization {runner.cfg.quantization}"
        )
    if not isinstance(model_path, str) or not model_path:
        raise ValueError(f"model_path must be a non-empty string, got {model_path!r}")
    try:
        folder = resolve_model_path(model_path)
        config = ModelConfig.from_pretrained(folder)
        safetensors_files(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the checkpoint {model_path!r}: {e}") from e
    differ = [
        f"{name} {getattr(config, name)!r} (running: {getattr(runner.model_config, name)!r})"
        for name in SHAPE_FIELDS
        if getattr(config, name) != getattr(runner.model_config, name)
    ]
    if differ:
        raise ValueError(
            f"the checkpoint {model_path!r} does not fit the running model: " + "; ".join(differ)
        )
    return folder


@torch.inference_mode()
def update_weights_from_disk(
    runner: ModelRunner, model_path: str, load_format: str | None = None
) -> str:
    """Loads ``model_path``'s weights into ``runner.model``; a message saying what was loaded.
    ValueError (the weights as they were) when the checkpoint cannot be used."""
    folder = _checkpoint(runner, model_path, load_format)
    try:
        runner.model.load_weights(iter_safetensors(folder))
    except Exception as e:
        _restore(runner)
        raise ValueError(
            f"loading {model_path!r} failed, the previous weights are back: {e}"
        ) from e
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()  # the load's transient copies go back to the driver
    previous, runner.model_dir = runner.model_dir, folder
    logger.warning("weights updated from %s (were %s)", folder, previous)
    return f"weights loaded from {folder}"


def _restore(runner: ModelRunner) -> None:
    if runner.cfg.load_format == "dummy":
        init_dummy_weights(runner.model)
    else:
        runner.model.load_weights(iter_safetensors(runner.model_dir))
