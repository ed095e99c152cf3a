"""OLMoE: q and k RMS-normalised over their whole width (all heads together, before rope),
optional ``clip_qkv``, every layer sparse, softmax top-k renormalised when ``norm_topk_prob``.

With tensor parallelism a rank holds some heads only: the mean square over the whole width is
the all-reduced sum of the ranks' partial sums (a KV head held by several ranks is counted once).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixlm.srt.distributed import TPGroup
from radixlm.srt.models.layers import RotaryEmbedding, copy_checked
from radixlm.srt.models.llama import DecoderOptions, LlamaAttention
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.moe import MoEConfig
from radixlm.srt.models.moe_decoder import MoEForCausalLM
from radixlm.srt.models.tp_layers import HeadShard, _check_shape, take


class WidthRMSNorm(nn.Module):
    """RMSNorm over ``full`` features of which this rank holds ``[start, start + length)``;
    ``copies``: how many ranks hold the same slice (their sums are divided by it)."""

    def __init__(self, full: int, start: int, length: int, copies: int, eps: float, tp: TPGroup):
        super().__init__()
        self.full, self.start, self.copies, self.eps, self.tp = full, start, copies, eps, tp
        self.weight = nn.Parameter(torch.empty(length), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        _check_shape(loaded, (self.full,))
        copy_checked(param.data, take(loaded, 0, self.start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        sum_sq = x32.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            sum_sq = self.tp.all_reduce(sum_sq / self.copies)
        return self.weight * (x32 * torch.rsqrt(sum_sq / self.full + self.eps)).to(x.dtype)


class OlmoeAttention(LlamaAttention):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        tp: TPGroup,
    ):
        super().__init__(config, layer_id, options, rotary, tp)
        heads = HeadShard.for_rank(config.num_heads, config.num_kv_heads, tp.size, tp.rank)
        hd, eps = config.head_dim, config.rms_norm_eps
        kv_copies = max(tp.size // config.num_kv_heads, 1)
        self.q_norm = WidthRMSNorm(
            config.num_heads * hd, heads.q_start * hd, heads.num_heads * hd, 1, eps, tp
        )
        self.k_norm = WidthRMSNorm(
            config.num_kv_heads * hd,
            heads.kv_start * hd,
            heads.num_kv_heads * hd,
            kv_copies,
            eps,
            tp,
        )
        self.clip_qkv = getattr(config.hf_config, "clip_qkv", None)

    def attend(
        self, rope: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor, fb: Any
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(qkv)
        qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return super().attend(rope, qkv, fb)


class OlmoeForCausalLM(MoEForCausalLM):
    attention_class = OlmoeAttention

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        bias = bool(getattr(config.hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias)  # q/k norms: OlmoeAttention's own

    @classmethod
    def moe_config(cls, config: ModelConfig) -> MoEConfig:
        return MoEConfig.from_hf(config.hf_config, intermediate_key="intermediate_size")
