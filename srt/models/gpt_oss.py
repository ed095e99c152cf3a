"""gpt-oss (``GptOssForCausalLM``): a Mixture-of-Experts decoder with attention sinks.

Where it differs from the other MoE families (``moe_decoder.py``):

* **attention**: q/k/v/o projections with biases; one learned **sink** logit per head joins
  every query's softmax and takes probability mass without a value
  (``kernels/attention/base.py``, served by the torch backend only); layers alternate between a
  sliding window (``layer_types``: ``sliding_attention``, ``sliding_window`` keys) and the whole
  prefix; YaRN rope (``rope_parameters``; cos and sin scaled by its attention factor);
* **router**: ``x W^T + b``; the top-k logits' softmax is the routing weight (the same as the
  full softmax's top k renormalised);
* **experts**: biased projections and a clamped SwiGLU, ``(clamp(up, -l, l) + 1) *
  g * sigmoid(alpha * g)`` with ``g = min(gate, l)`` (``swiglu_limit``; ``swiglu_alpha``, which
  the published configs leave out and older transformers fix at 1.702);
  the routing weight scales ``down(...) + down_bias``. The checkpoint stores every expert of a
  layer in one tensor, input-major (``gate_up_proj`` ``[E, hidden, 2 * inter]`` with gate and
  up columns interleaved, ``down_proj`` ``[E, inter, hidden]``); the loaders turn them into the
  ``[E, out, in]`` stacks of ``moe.py`` (gate rows, then up rows), this rank's experts and
  features only. Experts run in the torch path of ``kernels/moe.py`` on every device (the fused
  Triton kernels take neither biases nor this activation).

Only bf16/fp16/fp32 expert weights load: a checkpoint with a ``quantization_config`` (the
published MXFP4 ones) is refused by name.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixlm.kernels.moe import grouped_experts
from radixlm.srt.distributed import TPGroup
from radixlm.srt.models.gemma import SLIDING, check_layer_types, layer_types
from radixlm.srt.models.layers import RMSNorm, RotaryEmbedding, copy_checked
from radixlm.srt.models.llama import DecoderOptions, LlamaAttention
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.moe import ExpertShard, MoEConfig, TopKRouter
from radixlm.srt.models.moe_decoder import MoEDecoderLayer, MoEForCausalLM, MoEModel
from radixlm.srt.models.tp_layers import HeadShard, _check_shape, take

# the expert activation's sigmoid slope where a config does not give swiglu_alpha (the published
# gpt-oss configs give only swiglu_limit; transformers before 5.2x hard-codes this value)
SWIGLU_ALPHA = 1.702

if TYPE_CHECKING:
    pass


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float):
    """gpt-oss's expert activation (see the module docstring)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SinkAttention(LlamaAttention):
    """Llama's attention with this rank's heads' sink logits (``sinks`` ``[local heads]``) and
    a per-layer sliding window."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        sliding_window: int | None,
    ):
        super().__init__(config, layer_id, options, rotary, tp)
        self.sliding_window = sliding_window
        heads = HeadShard.for_rank(config.num_heads, config.num_kv_heads, tp.size, tp.rank)
        self.total_heads, self.q_start = config.num_heads, heads.q_start
        self.sinks = _param(self.num_heads)
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: Any) -> None:
        _check_shape(loaded, (self.total_heads,))
        copy_checked(param.data, take(loaded, 0, self.q_start, self.num_heads))


class GptOssExperts(nn.Module):
    """This rank's experts in ``moe.py``'s layout, with biases: ``gate_up_proj``
    ``[local, 2 * inter, hidden]``, ``gate_up_proj_bias`` ``[local, 2 * inter]``, ``down_proj``
    ``[local, hidden, inter]``, ``down_proj_bias`` ``[local, hidden]`` (``inter``: this rank's
    slice of the expert width). With the width split over ranks only the first slice's rank
    holds the down bias (the others zeros): the block's all-reduce adds it once."""

    def __init__(self, hidden: int, moe: MoEConfig, shard: ExpertShard, alpha: float, limit: float):
        super().__init__()
        self.hidden, self.inter_full, self.shard = hidden, moe.intermediate_size, shard
        local, inter = shard.num_local, shard.inter_len
        self.activation = functools.partial(clamped_swiglu, alpha=alpha, limit=limit)
        self.gate_up_proj = _param(local, 2 * inter, hidden)
        self.gate_up_proj_bias = _param(local, 2 * inter)
        self.down_proj = _param(local, hidden, inter)
        self.down_proj_bias = _param(local, hidden)
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.gate_up_proj_bias.weight_loader = self._load_gate_up_bias
        self.down_proj.weight_loader = self._load_down
        self.down_proj_bias.weight_loader = self._load_down_bias

    def _experts(self, loaded: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's experts of a whole-layer checkpoint tensor (shape checked)."""
        _check_shape(loaded, (self.shard.num_experts, *shape))
        return take(loaded, 0, self.shard.expert_start, self.shard.num_local)[:]

    def _gate_up_rows(self, interleaved: torch.Tensor) -> torch.Tensor:
        """``[..., 2 * inter_full]`` with gate/up interleaved -> ``[..., 2 * inter]``: this
        rank's gate features, then its up features."""
        start, length = self.shard.inter_start, self.shard.inter_len
        gate = interleaved[..., 0::2].narrow(-1, start, length)
        up = interleaved[..., 1::2].narrow(-1, start, length)
        return torch.cat((gate, up), -1)

    def _load_gate_up(self, param: nn.Parameter, loaded: Any) -> None:
        full = self._experts(loaded, (self.hidden, 2 * self.inter_full))
        copy_checked(param.data, self._gate_up_rows(full).transpose(1, 2))

    def _load_gate_up_bias(self, param: nn.Parameter, loaded: Any) -> None:
        copy_checked(param.data, self._gate_up_rows(self._experts(loaded, (2 * self.inter_full,))))

    def _load_down(self, param: nn.Parameter, loaded: Any) -> None:
        full = self._experts(loaded, (self.inter_full, self.hidden))
        rows = full.narrow(1, self.shard.inter_start, self.shard.inter_len)
        copy_checked(param.data, rows.transpose(1, 2))

    def _load_down_bias(self, param: nn.Parameter, loaded: Any) -> None:
        bias = self._experts(loaded, (self.hidden,))
        copy_checked(param.data, bias if self.shard.inter_start == 0 else torch.zeros_like(bias))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return grouped_experts(
            x,
            self.gate_up_proj,
            self.down_proj,
            self.shard.local_ids(topk_ids),
            topk_weights,
            gate_up_bias=self.gate_up_proj_bias,
            down_bias=self.down_proj_bias,
            activation=self.activation,
        )


class GptOssMoeBlock(nn.Module):
    """Router (with bias) and this rank's experts; one all-reduce. Counts the expert load as
    ``moe.SparseMoeBlock`` does (``expert_tokens``)."""

    def __init__(self, hidden: int, moe: MoEConfig, tp: TPGroup, alpha: float, limit: float):
        super().__init__()
        self.moe, self.tp = moe, tp
        self.router = TopKRouter(hidden, moe)
        shard = ExpertShard.for_rank(moe.num_experts, moe.intermediate_size, tp)
        self.experts = GptOssExperts(hidden, moe, shard, alpha, limit)
        self.register_buffer(
            "expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False
        )

    def forward(
        self, x: torch.Tensor, counted: torch.Tensor | None = None, stream: bool = False
    ) -> torch.Tensor:
        weights, ids = self.router.route_and_count(x, self.expert_tokens, counted, stream)
        return self.tp.all_reduce(self.experts(x, weights, ids))


class GptOssDecoderLayer(MoEDecoderLayer):
    is_sparse = True  # every gpt-oss layer routes to experts (MoEDecoderLayer.forward)

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        moe: MoEConfig,
    ):
        nn.Module.__init__(self)  # its own attention and experts; MoEDecoderLayer's forward
        hf = config.hf_config
        kind = GptOssForCausalLM.layer_types(config)[layer_id]
        window = int(hf.sliding_window) if kind == SLIDING else None
        self.self_attn = SinkAttention(config, layer_id, options, rotary, tp, window)
        alpha = float(getattr(hf, "swiglu_alpha", None) or SWIGLU_ALPHA)
        limit = float(hf.swiglu_limit)
        self.mlp = GptOssMoeBlock(config.hidden_size, moe, tp, alpha, limit)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _streams(self, hidden: torch.Tensor) -> bool:
        return False  # QKV biases and attention sinks: always the layer-by-layer path


class GptOssModel(MoEModel):
    def make_layer(
        self, config: ModelConfig, layer_id: int, options: DecoderOptions, tp: TPGroup
    ) -> nn.Module:
        return GptOssDecoderLayer(config, layer_id, options, self.rotary_emb, tp, self.moe)


class GptOssForCausalLM(MoEForCausalLM):
    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        hf = config.hf_config
        quant = getattr(hf, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ValueError(
                f"{config.architecture}: quantization_config ({method!r}) is not supported; "
                "load a checkpoint with bf16 (or fp16/fp32) expert weights"
            )
        check_layer_types(config)

    @staticmethod
    def layer_types(config: ModelConfig) -> list[str]:
        return layer_types(config)

    @classmethod
    def moe_config(cls, config: ModelConfig) -> MoEConfig:
        hf = config.hf_config
        return MoEConfig(
            num_experts=int(hf.num_local_experts),
            top_k=int(hf.num_experts_per_tok),
            intermediate_size=int(hf.intermediate_size),
            renormalize=True,  # softmax over the top-k logits
            router_bias=True,
        )

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        bias = bool(getattr(config.hf_config, "attention_bias", True))
        return DecoderOptions(qkv_bias=bias, o_bias=bias)

    def build_model(self, config: ModelConfig, tp: TPGroup) -> nn.Module:
        moe = self.moe_config(config)
        return GptOssModel(config, self.decoder_options(config), tp, moe, SinkAttention)
