"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention (per-head q/k RMSNorm),
routed experts of ``moe_intermediate_size``, softmax top-k renormalised when ``norm_topk_prob``."""

from __future__ import annotations

from radixlm.srt.models.llama import DecoderOptions
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.moe_decoder import MoEForCausalLM


class Qwen3MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        bias = bool(getattr(config.hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
