"""Qwen2: the Llama decoder with biases on the q, k and v projections."""

from __future__ import annotations

from radixlm.srt.models.llama import DecoderOptions, LlamaForCausalLM
from radixlm.srt.models.model_config import ModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
