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


def _check_updatable(runner: ModelRunner) -> None:
    if runner.tp.is_distributed:
        raise ValueError("updating weights is not supported with tensor parallelism yet")
    if runner.cfg.quantization != "none":
        raise ValueError(
            f"updating weights is not supported with --quantization {runner.cfg.quantization}"
        )
    scheme = getattr(runner.model, "quant_scheme", None)
    if scheme is not None:
        raise ValueError(
            f"updating weights is not supported for a quantised model ({scheme.label})"
        )


def _checkpoint(runner: ModelRunner, model_path: str, load_format: str | None) -> Path:
    """The folder to read, once everything that can be checked before writing is checked."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be auto or safetensors, got {load_format!r}")
    _check_updatable(runner)
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


TENSOR_LOAD_FORMATS = (None, "direct")


@torch.inference_mode()
def update_weights_from_tensor(
    runner: ModelRunner, named_tensors: object, load_format: str | None = None
) -> str:
    """SGLang's in-process ``update_weights_from_tensor``: ``named_tensors``, a list of
    ``(checkpoint name, tensor)`` pairs (Hugging Face names; any subset of the model's tensors,
    as RL loops send them in buckets), copied into the running weights in place (any device,
    any float dtype: converted). Every name and shape is checked before anything is written, so
    a refused call (ValueError naming the first bad pair) leaves the weights as they were. A
    tied ``lm_head.weight`` is skipped, as loading a checkpoint skips it."""
    if load_format not in TENSOR_LOAD_FORMATS:
        raise ValueError(
            f"load_format must be None or 'direct' (tensors given in-process), got "
            f"{load_format!r}; serialized tensor payloads are not supported"
        )
    _check_updatable(runner)
    if not isinstance(named_tensors, list | tuple):
        raise ValueError(
            f"named_tensors must be a list of (name, tensor) pairs, got {type(named_tensors).__name__}"
        )
    model, writes = runner.model, []
    tied = bool(getattr(runner.model_config, "tie_word_embeddings", False))
    for i, pair in enumerate(named_tensors):
        if not (
            isinstance(pair, list | tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], torch.Tensor)
        ):
            raise ValueError(f"named_tensors[{i}] must be a (name, torch.Tensor) pair")
        name, tensor = pair
        if name == "lm_head.weight" and tied:
            continue
        try:
            target = model.checkpoint_tensor(name)
        except KeyError as e:
            raise ValueError(f"named_tensors[{i}]: {e.args[0]}") from None
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"named_tensors[{i}] {name!r} has shape {tuple(tensor.shape)}, the model's is "
                f"{tuple(target.shape)}"
            )
        if tensor.device.type == "meta":
            raise ValueError(f"named_tensors[{i}] {name!r} is a meta tensor: it holds no values")
        if not tensor.is_floating_point():
            raise ValueError(
                f"named_tensors[{i}] {name!r} must be floating point, got {tensor.dtype}"
            )
        writes.append((target, tensor))
    for target, tensor in writes:
        target.copy_(tensor)
    return f"{len(writes)} weight tensor(s) updated in place"


# what one get_weights_by_name answer may carry (a float each): 100 rows of an 8B model's
# embedding are 409,600, of a 70B model's 819,200; the whole of it would be half a billion.
# An answer is ~50 MiB of Python floats and JSON on its way; the HTTP body model refuses more
# rows than this at once (server/native/protocol.py keeps the same figure).
MAX_WEIGHT_VALUES = 1 << 20


@torch.inference_mode()
def weights_by_name(runner: ModelRunner, name: str, truncate_size: int = 100) -> list:
    """SGLang's ``get_weights_by_name``: the running weight of checkpoint tensor ``name`` as
    float32 values, its first ``truncate_size`` rows (a vector: its first values). ValueError
    for a name the model lacks, a truncate_size under 1 or an answer over MAX_WEIGHT_VALUES."""
    if runner.tp.is_distributed:
        raise ValueError("reading weights is not supported with tensor parallelism yet")
    if runner.cfg.quantization != "none":
        raise ValueError(
            f"reading weights is not supported with --quantization {runner.cfg.quantization}"
        )
    scheme = getattr(runner.model, "quant_scheme", None)
    if scheme is not None:
        raise ValueError(f"reading weights is not supported for a quantised model ({scheme.label})")
    if isinstance(truncate_size, bool) or not isinstance(truncate_size, int) or truncate_size < 1:
        raise ValueError(f"truncate_size must be an integer >= 1, got {truncate_size!r}")
    try:
        rows = runner.model.checkpoint_tensor(name)[:truncate_size]
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    if rows.numel() > MAX_WEIGHT_VALUES:
        raise ValueError(
            f"truncate_size {truncate_size} asks for {rows.numel():,} values of {name!r}, over "
            f"the {MAX_WEIGHT_VALUES:,} one answer carries; ask for fewer rows"
        )
    return rows.float().cpu().tolist()


def _restore(runner: ModelRunner) -> None:
    if runner.cfg.load_format == "dummy":
        init_dummy_weights(runner.model)
    else:
        runner.model.load_weights(iter_safetensors(runner.model_dir))
