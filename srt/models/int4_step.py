"""The int4 Llama decoder's decode step in one C++ call on the CPU (``kernels/cpu_step.py``).

:meth:`Int4StepRunner.for_model` looks once at a model's layers: every one a plain
:class:`LlamaDecoderLayer` (no q/k norms, biases, soft-cap or sinks) whose four linears are
:class:`~radixlm.kernels.int4_cpu.Int4Linear` (``--quantization int4``) over float32 weights.
The model must be a plain ``LlamaModel`` (families that override its forward keep their own).
Then each decode batch of 1..``gguf_cpu.MAX_ROWS`` rows that the cpu attention backend serves
runs as embedding lookup, cos/sin, one call for the layers and the final norm; everything else
(prefill, bigger batches, an fp8 pool, KV calibration, the kernels switched off) takes the
layer-by-layer path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.kernels import cpu_step, gguf_cpu
from radixlm.kernels.attention.base import attention_sinks, attention_window, logit_cap
from radixlm.kernels.int4_cpu import Int4Linear
from radixlm.srt.models.layers import RMSNorm

if TYPE_CHECKING:
    from radixlm.srt.executor.forward_batch import ForwardBatch


def _int4(module: torch.nn.Module) -> Int4Linear | None:
    """The module's Int4Linear forward (set by ``quantize.py``) if it has no bias."""
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, Int4Linear) and fwd.bias is None else None


def _norms(layer) -> tuple:
    return (layer.input_layernorm, layer.post_attention_layernorm)


def _layer_weights(layer) -> cpu_step.LayerWeights | None:
    """What the step reads of ``layer``, None where it does not qualify."""
    from radixlm.srt.models.llama import LlamaDecoderLayer

    if type(layer) is not LlamaDecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qk_norm or logit_cap(attn) or attention_sinks(attn) is not None:
        return None
    if any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 for n in _norms(layer)):
        return None
    linears = [_int4(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(q is None or q.dense_weight.dtype != torch.float32 for q in linears):
        return None
    qkv, o, gate_up, down = (q.q4_1 for q in linears)
    norm1, norm2 = (n.weight for n in _norms(layer))
    return cpu_step.LayerWeights(norm1, norm2, qkv, o, gate_up, down, attention_window(attn))


def _q8_0_head(lm_head) -> gguf_cpu.Q8_0 | None:
    """The Q8_0 weight the int4 LM head multiplies 1..``MAX_ROWS`` rows by, if it does."""
    from radixlm.srt.models.quantize import SmallBatchLMHead

    fwd = None if lm_head is None else lm_head.__dict__.get("forward")
    if not isinstance(fwd, SmallBatchLMHead) or fwd.q8_0 is None:
        return None
    return fwd.q8_0


class Int4StepRunner:
    """Runs ``model`` (a ``LlamaModel``) through an :class:`cpu_step.Int4DecodeStep`."""

    def __init__(self, model, step: cpu_step.Int4DecodeStep):
        self.model, self.step = model, step
        self._pool = None  # the KV pool the step is bound to

    @classmethod
    def for_model(cls, model, lm_head=None) -> Int4StepRunner | None:
        """A runner where every layer qualifies (see the module docstring), else None;
        ``lm_head`` (an ``LMHead`` module): multiplied in the same call where it is int4 mode's
        Q8_0 head (``quantize.SmallBatchLMHead``)."""
        from radixlm.srt.models.llama import LlamaModel

        if type(model) is not LlamaModel or not len(model.layers):
            return None
        layers = [_layer_weights(layer) for layer in model.layers]
        norms = [n for layer in model.layers for n in _norms(layer)] + [model.norm]
        eps = {n.eps for n in norms}
        scales = {layer.self_attn.scaling for layer in model.layers}
        if any(w is None for w in layers) or len(eps) != 1 or len(scales) != 1:
            return None
        if type(model.norm) is not RMSNorm or model.norm.weight.dtype != torch.float32:
            return None
        first = model.layers[0]
        dims = cpu_step.Dims(
            hidden=first.input_layernorm.weight.shape[0],
            heads=first.self_attn.num_heads,
            kv_heads=first.self_attn.num_kv_heads,
            head_dim=first.self_attn.head_dim,
            inter=first.mlp.down_proj.in_features,
        )
        head = _q8_0_head(lm_head)
        step = cpu_step.Int4DecodeStep(
            layers, model.norm.weight, dims, eps.pop(), scales.pop(), head
        )
        return cls(model, step)

    def serves(self, input_ids: torch.Tensor, fb: ForwardBatch):
        """The batch's attention indices (``cpu_decode.DecodeBatch``) when the step takes this
        forward, else None."""
        if not (fb.mode.is_decode and input_ids.device.type == "cpu"):
            return None
        if not (0 < input_ids.shape[0] <= gguf_cpu.MAX_ROWS and cpu_step.available()):
            return None
        decode_batch = getattr(fb.attn_backend, "decode_batch", None)
        batch = decode_batch(fb, torch.float32) if decode_batch is not None else None
        if batch is None or fb.kv_pool.direct_write_target(0) is None:  # None: calibrating
            return None
        return batch

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, batch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the final norm's output ``[B, hidden]``, the logits ``[B, vocab]`` or None without
        a head in the step); the new K/V are in the pool."""
        pool, model = fb.kv_pool, self.model
        pool.layer_loads.wait_all()  # host-tier loads of every layer are in place
        if pool is not self._pool:
            kv = [pool.get_kv(i) for i in range(len(model.layers))]
            self.step.bind_pool([k for k, _ in kv], [v for _, v in kv])
            self._pool = pool
        residual = model.embed_tokens(input_ids)
        cos, sin = model.rotary_emb.cos_sin(positions, torch.float32)
        return self.step.run(residual, batch, cos, sin)
