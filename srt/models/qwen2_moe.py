"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases), routed experts
plus a shared expert scaled per token by ``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from radixlm.srt.models.llama import DecoderOptions
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.moe_decoder import MoEForCausalLM


class Qwen2MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(getattr(config.hf_config, "qkv_bias", True)))
