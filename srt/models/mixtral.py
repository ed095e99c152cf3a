"""Mixtral: Llama's attention, every layer sparse (``block_sparse_moe``: experts ``w1`` gate,
``w3`` up, ``w2`` down, each of ``intermediate_size``), softmax top-k always renormalised."""

from __future__ import annotations

from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.moe import MoEConfig
from radixlm.srt.models.moe_decoder import MoEForCausalLM
from radixlm.srt.models.weight_map import WeightMap

MIXTRAL_WEIGHTS = WeightMap(
    renames=(
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )
)


class MixtralForCausalLM(MoEForCausalLM):
    weight_map = MIXTRAL_WEIGHTS

    def __init__(self, config: ModelConfig, *args, **kwargs):
        window = getattr(config.hf_config, "sliding_window", None)
        if window is not None and window < config.context_length:
            raise ValueError(
                f"{config.architecture}: sliding_window {window} (shorter than the context "
                f"length {config.context_length}) is not supported by the MoE models yet"
            )
        super().__init__(config, *args, **kwargs)

    @classmethod
    def moe_config(cls, config: ModelConfig) -> MoEConfig:
        return MoEConfig.from_hf(
            config.hf_config, intermediate_key="intermediate_size", renormalize=True
        )
