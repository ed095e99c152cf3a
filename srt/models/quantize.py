"""Weight-only quantization of a loaded model: ``--quantization int4`` (CPU only).

At batch 1 a CPU decode step streams every weight once per token; with float32 weights the
linear layers are nearly the whole step. ``int4`` gives every ``Linear`` (``QKVLinear`` and
``MergedLinear`` included) an :class:`~radixlm.kernels.int4_cpu.Int4Linear`: 4-bit weights in
groups of 32 (GGUF's Q4_1 layout) multiplied with int8 activations per block of 32 (the C++
kernels of ``kernels/gguf_cpu.py``, as llama.cpp does) while a decode forward has at most
``gguf_cpu.MATMUL_ROWS`` (128) rows and a forward with prompt tokens at most ``PROMPT_ROWS`` (16),
the layer's own dense weight for more rows (prefill chunks, large decode batches), where the
dense matmul is faster or the prompt's float32 activations matter; where the C++ kernels are off,
bfloat16 activations through torch's packed kernel for at most ``int4_cpu.PACKED_INT4_ROWS``
(16). The LM head gets Q8_0 blocks of its weight with int16 activations (the C++ kernel, for the
same rows; a per-channel int8 copy and bfloat16 activations for at most ``PACKED_INT4_ROWS``
rows where it is off) (:class:`SmallBatchLMHead`).

Precision. For a GGUF model whose linear weights are Q4_1 (the default SmolLM2) the int4 codes
are the file's own: re-quantizing the dequantized weights recovers them, and only the
activations' rounding is added: int8 per block with the C++ GEMV (half a step of
``max|block| / 127`` per element), else bfloat16 (also on scales and zeros). For other weights
(safetensors, other GGUF types) int4 is round-to-nearest quantization and lossy; check a model's outputs before relying
on it. Results depend on the batch's row count, since small and large batches take different
paths (as GPU kernels do).

LM head, measured on SmolLM2 (tied to its Q8_0 embedding; 2-core AVX2 CPU): max |logit error|
against float32 over 306 positions, then the median of 5 whole decode steps with int4 linear
layers at 1 and 4 rows: int4 4.6 (top-1 agreement 87%); per-channel int8 0.80 (98.4%; 24.9 and
43.2 ms); bfloat16 0.20 (98.7%; 26.3 and 48.3 ms); float32 (30.8 and 62.5 ms). int8 is the
fastest at every row count measured and its error is of the size the int4 linear layers already
add (0.3-0.8, from bfloat16 activations); bfloat16 matmuls slow down quickly with rows on a CPU
without bf16 instructions. (That was against torch's packed kernels; the C++ Q8_0 head now reads
the embedding's own Q8_0 codes, exact for SmolLM2, with activations rounded to 2**-16 of each
block's largest value.)

The layers keep their parameters: quantization sets an instance-level ``forward`` on each
module it converts, so ``named_parameters``, the weight loaders and the tied embedding are
untouched (``model.lm_head.weight`` stays the embedding's).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import gguf_cpu
from radixlm.kernels.int4_cpu import (
    PACKED_INT4_ROWS,
    PROMPT_ROWS,
    Int4Linear,
    can_pack_int4,
    small_rows_limit,
)
from radixlm.kernels.int8_cpu import int8_matmul, quantize_int8
from radixlm.srt.models.layers import Linear, LMHead
from radixlm.srt.models.quant.linear import quantize_model_fp8

logger = logging.getLogger(__name__)


class SmallBatchLMHead:
    """Logits ``[N, vocab]`` float32 for at most ``gguf_cpu.matmul_rows()`` rows: GGUF's Q8_0 blocks of the
    weight times int16 activations (``gguf_cpu.py``; for a Q8_0 embedding, as SmolLM2's, the
    file's own codes, so the logits are the dense ones up to 2**-16 of each activation block;
    int8 activations, as llama.cpp's, flip SmolLM2's answer to "the capital of France", whose
    two best first tokens are 0.08 apart) where the C++ kernels serve, else a per-channel int8 weight and bfloat16
    activations (at most ``PACKED_INT4_ROWS`` rows); the model-dtype weight for more rows."""

    def __init__(self, weight: torch.Tensor):
        self.dense_weight = weight  # [vocab, hidden] model dtype (may be the tied embedding)
        q = quantize_int8(weight)
        self.codes = q.codes  # [vocab, hidden] int8
        self.scales = q.scales.to(torch.bfloat16)  # [vocab] bfloat16
        blocks = weight.shape[1] % gguf_cpu.BLOCK == 0
        self.q8_0 = gguf_cpu.quantize_q8_0(weight) if blocks else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        native = self.q8_0 is not None and gguf_cpu.available()
        if rows > small_rows_limit(native):
            return F.linear(hidden, self.dense_weight).float()
        if native and hidden.stride(-1) == 1 and gguf_cpu.serves(hidden, rows):
            return gguf_cpu.q8_0_matmul(hidden, self.q8_0, int16=True)
        return int8_matmul(hidden, self.codes, self.scales).float()


@torch.inference_mode()
def quantize_model(model: nn.Module, mode: str, device: torch.device) -> None:
    """Applies ``mode`` (``"none"``, ``"int4"`` or ``"fp8"``) to ``model`` in place, after its
    weights were loaded. ``fp8``: ``quant/linear.quantize_model_fp8`` (any device)."""
    if mode == "none":
        return
    if getattr(model, "quant_scheme", None) is not None:
        raise ValueError(
            f"--quantization {mode} cannot be applied to a checkpoint that is quantised already "
            f"({model.quant_scheme.label}); drop the option"
        )
    if mode == "fp8":
        count = quantize_model_fp8(model)
        logger.info("fp8: %d linear layers quantised at load (per-channel weights)", count)
        return
    if mode != "int4":
        raise ValueError(f"unknown quantization {mode!r}; supported: none, int4, fp8")
    if device.type != "cpu":
        raise ValueError(
            f"--quantization int4 runs on the CPU only (device is {device}); "
            "drop the option or pass --device cpu"
        )
    tp_size = getattr(getattr(model, "tp", None), "size", 1)
    if tp_size > 1:  # the int4 forwards replace the row-parallel all-reduce and logits gather
        raise ValueError(
            f"--quantization int4 does not support tensor parallelism (tp_size {tp_size}); "
            "drop --quantization or use --tp-size 1"
        )
    converted, kept = _int4_linears(model)
    for module in model.modules():
        if isinstance(module, LMHead):
            module.forward = SmallBatchLMHead(module.weight.data)
    logger.info(
        "int4: %d linear layers converted, %d kept dense%s; they and the LM head (Q8_0) "
        "multiply %s; more rows take the dense weights",
        converted,
        len(kept),
        f" ({', '.join(kept[:4])}...)" if kept else "",
        f"through the C++ kernels ({gguf_cpu.isa()}) for at most {gguf_cpu.matmul_rows()} "
        f"decode rows ({PROMPT_ROWS} with prompt tokens)"
        if gguf_cpu.available()
        else f"through torch's int4/int8 kernels for at most {PACKED_INT4_ROWS} rows",
    )


def _int4_linears(model: nn.Module) -> tuple[int, list[str]]:
    """Converts every packable Linear; returns (number converted, names of those kept dense)."""
    converted, kept = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if not can_pack_int4(module.out_features, module.in_features):
            kept.append(name)
            continue
        bias = module.bias.data if module.bias is not None else None
        module.forward = Int4Linear(module.weight.data, bias)
        converted += 1
    return converted, kept
