"""Mistral: the Llama decoder; every layer attends over a sliding window where the config sets one."""

from __future__ import annotations

from radixlm.srt.models.llama import DecoderOptions, LlamaForCausalLM
from radixlm.srt.models.model_config import ModelConfig


def config_sliding_window(config: ModelConfig) -> int | None:
    """The config's ``sliding_window`` (keys a query sees, its own included), None when unset."""
    window = getattr(config.hf_config, "sliding_window", None)
    if window is None:
        return None
    if int(window) < 1:
        raise ValueError(f"{config.architecture}: sliding_window must be >= 1, got {window}")
    return int(window)


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(sliding_window=config_sliding_window(config))
