"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rope (head_dim from config)."""

from __future__ import annotations

from radixlm.srt.models.llama import DecoderOptions, LlamaForCausalLM
from radixlm.srt.models.model_config import ModelConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        bias = bool(getattr(config.hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
