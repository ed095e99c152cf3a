"""Gemma 2 and Gemma 3 (text): the Llama attention and weight names with Gemma's own layer.

Where they differ from Llama: RMSNorm scales by ``1 + weight``; each layer norms the attention
and MLP outputs too (``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``); the MLP is ``gelu_tanh(gate) * up``; embeddings are multiplied
by ``sqrt(hidden_size)`` (rounded to the model's dtype); the attention scale is
``query_pre_attn_scalar ** -0.5``; layers alternate between a sliding window
(``layer_types``: ``sliding_attention``) and the whole prefix (``full_attention``); final logits
are soft-capped (``c * tanh(logits / c)``) where the config says. Gemma 2 also soft-caps the
attention scores (``attn_logit_softcapping``); Gemma 3 instead norms q and k per head and gives
local and global layers their own rope base (``rope_parameters`` per layer type).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import fused
from radixlm.srt.distributed import TPGroup
from radixlm.srt.models.layers import RMSNorm, RotaryEmbedding
from radixlm.srt.models.llama import DecoderOptions, GatedMLP, LlamaAttention, LlamaForCausalLM
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.tp_layers import VocabParallelEmbedding

if TYPE_CHECKING:
    from radixlm.srt.executor.forward_batch import ForwardBatch

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def layer_types(config: ModelConfig) -> list[str]:
    """Each layer's attention kind, SLIDING or FULL (models that alternate windowed and global
    layers: Gemma 2/3, gpt-oss); configs without ``layer_types`` slide on even layers, as
    transformers reads them."""
    types = getattr(config.hf_config, "layer_types", None)
    if types is None:
        types = [SLIDING if i % 2 == 0 else FULL for i in range(config.num_layers)]
    if len(types) != config.num_layers:
        raise ValueError(
            f"{config.architecture}: {len(types)} layer_types for {config.num_layers} layers"
        )
    return list(types)


def check_layer_types(config: ModelConfig) -> None:
    """Refuses layer kinds other than SLIDING and FULL, and sliding layers without a window."""
    kinds = set(layer_types(config))
    if not kinds <= {SLIDING, FULL}:
        raise ValueError(
            f"{config.architecture}: layer_types {sorted(kinds)} are not supported "
            f"(only {SLIDING!r} and {FULL!r})"
        )
    if SLIDING in kinds and not getattr(config.hf_config, "sliding_window", None):
        raise ValueError(f"{config.architecture}: sliding layers need a sliding_window")


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` (the checkpoint stores the offset from one), in float32."""

    def scale(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() + 1.0).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.available(x):
            flat = x.reshape(-1, x.shape[-1])
            return fused.rmsnorm(flat, self.scale(x.dtype), self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.scale(torch.float32)).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if fused.available(x) and x.dim() == 2:
            return fused.add_rmsnorm(x, residual, self.scale(x.dtype), self.eps)
        summed = x + residual
        return self.forward(summed), summed


class GeluTanhMLP(GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        sliding_window: int | None,
        attn_logit_cap: float,
    ):
        super().__init__()
        hf, eps, hidden = config.hf_config, config.rms_norm_eps, config.hidden_size
        attn = self.self_attn = LlamaAttention(config, layer_id, options, rotary, tp)
        attn.scaling = float(getattr(hf, "query_pre_attn_scalar", None) or config.head_dim) ** -0.5
        attn.sliding_window = sliding_window
        attn.logit_cap = attn_logit_cap
        if options.qk_norm:
            attn.q_norm = GemmaRMSNorm(config.head_dim, eps)
            attn.k_norm = GemmaRMSNorm(config.head_dim, eps)
        self.mlp = GeluTanhMLP(hidden, config.intermediate_size, tp)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual)`` as ``LlamaDecoderLayer`` does."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden, fb))
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        options: DecoderOptions,
        tp: TPGroup,
        layer_types: list[str],
        rope_params: dict[str, tuple[float, dict[str, Any] | None]],
        attn_logit_cap: float,
    ):
        super().__init__()
        window = int(config.hf_config.sliding_window)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embed_scale = config.hidden_size**0.5
        self.layer_types = layer_types
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(config.head_dim, config.context_length, theta, scaling)
                for kind, (theta, scaling) in rope_params.items()
            }
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config,
                i,
                options,
                self.rotary[kind],
                tp,
                window if kind == SLIDING else None,
                attn_logit_cap,
            )
            for i, kind in enumerate(layer_types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # the scale rounded to the activations' dtype first, as the checkpoints were trained
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype).item()
        ropes = {kind: r.cos_sin(positions, hidden.dtype) for kind, r in self.rotary.items()}
        residual = None
        for layer, kind in zip(self.layers, self.layer_types, strict=True):
            hidden, residual = layer(ropes[kind], hidden, residual, fb)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    QK_NORM = False

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        hf = config.hf_config
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
        if act not in GELU_TANH:
            raise ValueError(
                f"{config.architecture}: hidden activation {act!r} is not supported "
                f"(only {' or '.join(GELU_TANH)})"
            )
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError(f"{config.architecture}: bidirectional attention is not supported")
        if getattr(hf, "attention_bias", False):
            raise ValueError(f"{config.architecture}: attention_bias is not supported")
        check_layer_types(config)

    @staticmethod
    def layer_types(config: ModelConfig) -> list[str]:
        return layer_types(config)

    @classmethod
    def rope_params(cls, config: ModelConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
        """``{layer type: (rope theta, rope scaling)}``: one rope for every layer."""
        return dict.fromkeys(set(cls.layer_types(config)), (config.rope_theta, config.rope_scaling))

    @classmethod
    def attn_logit_cap(cls, config: ModelConfig) -> float:
        return float(getattr(config.hf_config, "attn_logit_softcapping", None) or 0.0)

    def build_model(self, config: ModelConfig, tp: TPGroup) -> nn.Module:
        return GemmaModel(
            config,
            DecoderOptions(qk_norm=self.QK_NORM),
            tp,
            self.layer_types(config),
            self.rope_params(config),
            self.attn_logit_cap(config),
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = getattr(self.config.hf_config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    QK_NORM = True

    @classmethod
    def rope_params(cls, config: ModelConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
        """Per layer type from ``rope_parameters`` (transformers 5), else the global
        ``rope_theta``/``rope_scaling`` and ``rope_local_base_freq`` for sliding layers."""
        hf = config.hf_config
        per_type = getattr(hf, "rope_parameters", None) or {}
        out = {}
        for kind in set(cls.layer_types(config)):
            params = per_type.get(kind)
            if isinstance(params, dict) and "rope_theta" in params:
                scaling = {k: v for k, v in params.items() if k != "rope_theta"}
                if scaling.get("rope_type", "default") == "default":
                    scaling = None
                out[kind] = (float(params["rope_theta"]), scaling)
            elif kind == SLIDING:
                out[kind] = (float(getattr(hf, "rope_local_base_freq", 10000.0)), None)
            else:
                out[kind] = (config.rope_theta, config.rope_scaling)
        return out

    @classmethod
    def attn_logit_cap(cls, config: ModelConfig) -> float:
        return 0.0  # Gemma 3 does not cap attention scores (its config field goes unused)
