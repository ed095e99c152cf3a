"""The accuracy check of a quantised model at load (``--quantization-check on``, the default).

Once, before any request: the first ``MAX_CHECK_TOKENS`` (128) tokens of the built-in
calibration text of the FP8-KV calibration (``kv_calibration.CALIBRATION_TEXT``) run as one
prefill through the model twice (the check's whole cost: two short prefills), once with
the quantised layers and once with the reference weights, and the next-token distributions of
every position are compared:

- ``mean_kl``: mean over positions of ``KL(reference || quantised)`` in nats;
- ``top1_agreement``: the share of positions whose argmax is the same.

The reference of a checkpoint that is quantised on disk is its dequantised weights in float32
with unquantised activations (``quant.linear.reference_weights``): what the format costs beyond
its weights' rounding (the activations' FP8 rounding, the kernels' arithmetic). With
``--quantization fp8`` the reference is the checkpoint's own weights: the check runs before the
layers are quantised, so it measures the whole cost of quantising.

The forwards use a KV pool of their own (the text's tokens) and the torch attention backend,
so they run before the runner sizes its pools; with tensor parallelism every rank runs them
(the logits are gathered on every rank). The figures go to the start-up log and to
``/server_info`` (``kv_pool.quantization_report``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from radixlm.kernels.attention.torch_backend import TorchAttentionBackend
from radixlm.srt.executor.forward_batch import ForwardBatch
from radixlm.srt.executor.kv_calibration import CALIBRATION_TEXT
from radixlm.srt.executor.memory_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from radixlm.srt.models.quant.linear import reference_weights
from radixlm.srt.models.quantize import quantize_model

logger = logging.getLogger(__name__)

MAX_CHECK_TOKENS = 128  # two prefills of this many tokens: a few seconds on a CPU


def check_token_ids(tokenizer: Any, vocab_size: int, context_length: int) -> list[int]:
    """The calibration text's ids the model knows, at most ``MAX_CHECK_TOKENS`` and the context."""
    ids = [t for t in tokenizer.encode(CALIBRATION_TEXT) if 0 <= t < vocab_size]
    return ids[: min(MAX_CHECK_TOKENS, context_length)] or [0]


@torch.inference_mode()
def prefill_logits(
    model: nn.Module, token_ids: list[int], num_kv_heads: int, device: torch.device
) -> torch.Tensor:
    """Logits ``[T, vocab]`` float32 of one prefill of ``token_ids`` (a private KV pool)."""
    config = model.config
    n = len(token_ids)
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    if dtype.itemsize == 1:  # an FP8 weight first: the activations' dtype is the norms'
        dtype = model.model.norm.weight.dtype
    kv_pool = KVPool(n + 1, config.num_layers, num_kv_heads, config.head_dim, dtype, device)
    table = ReqToTokenPool(1, n + 1, device)
    allocator = TokenSlotAllocator(n + 1, 1, device)
    backend = TorchAttentionBackend()
    fb = ForwardBatch.one_prompt(
        token_ids,
        table.alloc(),
        allocator.alloc(n),
        req_to_token_pool=table,
        kv_pool=kv_pool,
        attn_backend=backend,
    )
    return model.compute_logits(model(fb.input_ids, fb.positions, fb)).float()


def compare(reference: torch.Tensor, quantised: torch.Tensor) -> dict[str, float]:
    """Mean KL(reference || quantised) over positions and the top-1 agreement."""
    ref_log = torch.log_softmax(reference.float(), dim=-1)
    q_log = torch.log_softmax(quantised.float(), dim=-1)
    kl = (ref_log.exp() * (ref_log - q_log)).sum(-1)
    agree = (reference.argmax(-1) == quantised.argmax(-1)).float()
    return {"mean_kl": float(kl.mean()), "top1_agreement": float(agree.mean())}


def check_quantisation(
    model: nn.Module,
    token_ids: list[int],
    num_kv_heads: int,
    device: torch.device,
    quantise: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Runs the check (see the module docstring). ``quantise``: quantises the model in place
    (``--quantization fp8``): called between the reference pass and the quantised one. Returns
    the report for ``/server_info``."""
    start = time.perf_counter()
    if quantise is not None:
        reference = prefill_logits(model, token_ids, num_kv_heads, device)
        quantise()
        quantised = prefill_logits(model, token_ids, num_kv_heads, device)
        against = "the checkpoint's weights"
    else:
        quantised = prefill_logits(model, token_ids, num_kv_heads, device)
        with reference_weights(model):
            reference = prefill_logits(model, token_ids, num_kv_heads, device)
        against = "dequantised weights in float32, activations unquantised"
    report = {
        "scheme": model.quant_scheme.label,
        "reference": against,
        "tokens": len(token_ids),
        **{k: round(v, 6) for k, v in compare(reference, quantised).items()},
    }
    logger.info(
        "quantisation check (%s) over %d tokens of the built-in text against %s: mean KL %.5f "
        "nats, top-1 agreement %.2f%% (%.1f s)",
        report["scheme"],
        report["tokens"],
        against,
        report["mean_kl"],
        100 * report["top1_agreement"],
        time.perf_counter() - start,
    )
    return report


def quantise_and_check(
    model: nn.Module,
    cfg: Any,
    tokenizer: Any,
    model_config: Any,
    num_kv_heads: int,
    device: torch.device,
) -> dict[str, Any] | None:
    """``--quantization`` applied to the loaded model, then (or around it, for ``fp8``) the
    check when the model is quantised and ``--quantization-check`` is on; returns the report
    (None without a check)."""

    def quantise() -> None:
        quantize_model(model, cfg.quantization, device)

    def ids() -> list[int]:
        return check_token_ids(tokenizer, model_config.vocab_size, model_config.context_length)

    check = cfg.quantization_check == "on"
    if check and cfg.quantization == "fp8":
        return check_quantisation(model, ids(), num_kv_heads, device, quantise=quantise)
    quantise()
    if check and getattr(model, "quant_scheme", None) is not None:
        return check_quantisation(model, ids(), num_kv_heads, device)
    return None
