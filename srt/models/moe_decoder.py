"""The Mixture-of-Experts decoder: Llama's attention and norms, a sparse MoE block as the MLP.

Families differ in their attention options, the checkpoint's names, where the MoE options live
in the config and which layers are sparse (``decoder_sparse_step``, ``mlp_only_layers``: the
others get a dense MLP of ``intermediate_size``). Each family is a small subclass of
:class:`MoEForCausalLM` that says so (``qwen2_moe.py``, ``qwen3_moe.py``, ``mixtral.py``,
``olmoe.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixlm.srt.distributed import TPGroup
from radixlm.srt.models.layers import RMSNorm, RotaryEmbedding
from radixlm.srt.models.llama import (
    DecoderOptions,
    GatedMLP,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    attention_half,
    streamable,
)
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.moe import MoEConfig, SparseMoeBlock

if TYPE_CHECKING:  # annotations only: at run time the models never import the executor
    from radixlm.srt.executor.forward_batch import ForwardBatch

# the KV slot padding rows write (CUDA-graph padding; never handed out, executor/memory_pool.py):
# the expert-load table leaves those rows out
PADDING_KV_SLOT = 0


class MoEDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        moe: MoEConfig,
        attention_class: type[LlamaAttention] = LlamaAttention,
    ):
        super().__init__()
        self.self_attn = attention_class(config, layer_id, options, rotary, tp)
        self.is_sparse = moe.is_sparse(layer_id)
        if self.is_sparse:
            self.mlp: nn.Module = SparseMoeBlock(config.hidden_size, moe, tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._stream_ok: dict[tuple, bool] = {}  # can_stream's weight checks per dtype/device

    def _streams(self, hidden: torch.Tensor) -> bool:
        return hidden.is_cuda and self.can_stream(hidden)

    def can_stream(self, hidden: torch.Tensor) -> bool:
        """Whether the attention half takes the weight-streaming kernels (a few rows, one rank,
        plain weights: ``llama.streamable``), and the router's matmul with it; the experts run as
        on the layer path."""
        attn = self.self_attn
        return streamable(self._stream_ok, hidden, (attn.qkv_proj, attn.o_proj))

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
        counted: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer.forward``; ``counted``: the rows the expert-load table counts."""
        stream = self._streams(hidden)
        hidden, residual = attention_half(self, rope, hidden, residual, fb, stream)
        if self.is_sparse:
            return self.mlp(hidden, counted, stream), residual
        return self.mlp(hidden), residual


class MoEModel(LlamaModel):
    def __init__(
        self,
        config: ModelConfig,
        options: DecoderOptions,
        tp: TPGroup,
        moe: MoEConfig,
        attention_class: type[LlamaAttention],
    ):
        self.moe, self.attention_class = moe, attention_class
        super().__init__(config, options, tp)

    def make_layer(
        self, config: ModelConfig, layer_id: int, options: DecoderOptions, tp: TPGroup
    ) -> nn.Module:
        return MoEDecoderLayer(
            config, layer_id, options, self.rotary_emb, tp, self.moe, self.attention_class
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        counted = (fb.out_kv_slots != PADDING_KV_SLOT).long()  # [T]
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb.cos_sin(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, fb, counted)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


class MoEForCausalLM(LlamaForCausalLM):
    """The contract of :class:`LlamaForCausalLM`, plus :meth:`expert_load`."""

    attention_class: type[LlamaAttention] = LlamaAttention

    @classmethod
    def moe_config(cls, config: ModelConfig) -> MoEConfig:
        return MoEConfig.from_hf(config.hf_config, intermediate_key="moe_intermediate_size")

    def build_model(self, config: ModelConfig, tp: TPGroup) -> nn.Module:
        moe = self.moe_config(config)
        return MoEModel(config, self.decoder_options(config), tp, moe, self.attention_class)

    def sparse_blocks(self) -> list[tuple[int, SparseMoeBlock]]:
        return [(i, layer.mlp) for i, layer in enumerate(self.model.layers) if layer.is_sparse]

    def expert_load(self) -> dict[str, Any]:
        """Tokens routed to each expert since start, per sparse layer (reads the device
        counters: one sync). Every rank routes every token, so any rank's table is the whole
        model's."""
        blocks = self.sparse_blocks()
        moe = self.model.moe
        table = torch.stack([b.expert_tokens for _, b in blocks]).cpu().tolist() if blocks else []
        return {
            "num_experts": moe.num_experts,
            "top_k": moe.top_k,
            "ep_size": self.tp.ep_size,
            "layers": [i for i, _ in blocks],
            "tokens_per_expert": table,  # [sparse layer][expert], cumulative
            # the busiest expert's tokens over the mean (1.0: even; 0 before any token)
            "imbalance": [
                round(max(row) * len(row) / sum(row), 4) if sum(row) else 0.0 for row in table
            ],
        }
