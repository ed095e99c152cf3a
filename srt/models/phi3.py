"""Phi-3: the Llama decoder; its checkpoints fuse q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``, split here into the shards our merged projections load (so each
tensor-parallel rank keeps its rows of each); a sliding window where the config sets one."""

from __future__ import annotations

from typing import Any

from radixlm.srt.models.llama import DecoderOptions, LlamaForCausalLM
from radixlm.srt.models.mistral import config_sliding_window
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.tp_layers import shape_of, take


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        hf = config.hf_config
        params = getattr(hf, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
        if factor not in (None, 1.0):
            raise ValueError(
                f"{config.architecture}: partial_rotary_factor {factor} is not supported (only 1.0)"
            )

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(sliding_window=config_sliding_window(config))

    def weight_targets(
        self, ckpt_name: str, tensor: Any
    ) -> list[tuple[str, str | int | None, Any]]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for fused, shards, sizes in (
            (".qkv_proj.", ("q", "k", "v"), (q, kv, kv)),
            (".gate_up_proj.", (0, 1), (c.intermediate_size, c.intermediate_size)),
        ):
            if fused not in ckpt_name:
                continue
            rows = shape_of(tensor)[0]
            if rows != sum(sizes):
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} has {rows} rows, expected "
                    f"{sum(sizes)} ({' + '.join(map(str, sizes))})"
                )
            pieces, start = [], 0
            for shard_id, size in zip(shards, sizes, strict=True):
                pieces.append((ckpt_name, shard_id, take(tensor, 0, start, size)))
                start += size
            return pieces
        return super().weight_targets(ckpt_name, tensor)
