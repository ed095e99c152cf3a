"""Builds a model from a Hugging Face folder (config.json + safetensors); its tokenizer: ``tokenizer``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from radixlm.srt.distributed import TPGroup
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.quant.linear import finalize_model, prepare_model
from radixlm.srt.models.quant.scheme import read_scheme
from radixlm.srt.models.registry import get_model_class

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files: those named by the shard index if there is one, else every ``*.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir} has no *.safetensors files (a Hugging Face model folder was expected)"
        )
    return files


def iter_safetensors(model_dir: str | Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yields ``(name, tensor)`` for every tensor of the checkpoint, one file at a time (on CPU).
    ``lazy``: a safetensors slice instead of the tensor, valid until the next item; the weight
    loaders read only the rows or columns their rank keeps (tensor parallelism)."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_slice(name) if lazy else f.get_tensor(name)


@torch.inference_mode()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: N(0, 0.02) matrices and biases, ones for norm scales."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() == 1 and "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)


@torch.inference_mode()
def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    dummy: bool = False,
    tp: TPGroup | None = None,
) -> nn.Module:
    """The model of ``model_dir`` in ``dtype`` on ``device``, weights loaded, in eval mode.

    The result has ``forward(input_ids, positions, fb)``, ``compute_logits(hidden)`` and a
    ``config`` attribute (:class:`ModelConfig`). With a ``tp`` group of several ranks the model
    holds this rank's slices only, read from the checkpoint slice by slice. A checkpoint whose
    config has a ``quantization_config`` gets quantised linear layers (``quant/``).
    """
    config = ModelConfig.from_pretrained(model_dir)
    model_class = get_model_class(config.architecture)
    tp = tp or TPGroup.single()
    model = model_class(config, dtype, torch.device(device), tp=tp)
    scheme = read_scheme(model_dir)  # quantization_config of config.json, if any
    if scheme is not None and dummy:
        raise ValueError(
            f"load_format dummy cannot fill a quantised checkpoint ({scheme.method}); "
            "use load_format auto"
        )
    if scheme is not None:
        layers = prepare_model(model, scheme)
        logger.info("quantised checkpoint: %s, %d linear layers", scheme.label, layers)
    if dummy:
        init_dummy_weights(model)
    else:
        model.load_weights(iter_safetensors(model_dir, lazy=tp.is_distributed))
    if scheme is not None:
        finalize_model(model, scheme, dtype)
    logger.info(
        "loaded %s from %s (%d layers, %s, %s)",
        config.architecture,
        model_dir,
        config.num_layers,
        dtype,
        device,
    )
    return model.eval()
