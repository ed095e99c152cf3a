"""Llama-family decoder (SmolLM2, Llama 3.x); Qwen2 and Qwen3 reuse it with other options."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixlm.kernels import cpu_decode, fused, gemv
from radixlm.srt.distributed import TPGroup
from radixlm.srt.models.int4_step import Int4StepRunner
from radixlm.srt.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    default_dtype,
    default_weight_loader,
    silu_and_mul,
)
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.tp_layers import (
    ColumnParallelLinear,
    HeadShard,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from radixlm.srt.models.weight_map import LLAMA_WEIGHTS, WeightMap

if TYPE_CHECKING:  # annotations only: at run time the models never import the executor
    from radixlm.srt.executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class DecoderOptions:
    """Where architectures of the family differ."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3)
    sliding_window: int | None = None  # every layer sees its last W keys (Mistral, Phi-3)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate and up merged and column-parallel, down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, bias: bool = False):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.even(
            hidden_size, [intermediate_size] * 2, tp, bias
        )
        self.down_proj = RowParallelLinear.even(intermediate_size, hidden_size, tp, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """This rank's heads (``num_heads``/``num_kv_heads`` are the local counts the attention
    backend reads); q/k/v column-parallel, o_proj row-parallel."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        tp: TPGroup,
    ):
        super().__init__()
        self.layer_id = layer_id
        heads = HeadShard.for_rank(config.num_heads, config.num_kv_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = hd = config.head_dim
        self.scaling = self.head_dim**-0.5
        # read by the attention backends (``kernels/attention/base.py``); Gemma sets them per layer
        self.sliding_window = options.sliding_window
        self.logit_cap = 0.0
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, hd, config.num_heads, config.num_kv_heads, heads, options.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * hd,
            config.hidden_size,
            (heads.q_start * hd, heads.num_heads * hd),
            tp,
            options.o_bias,
        )
        self.rotary_emb = rotary  # shared by all layers
        self.qk_norm = options.qk_norm
        self.fused_rope = self.head_dim & (self.head_dim - 1) == 0  # the kernel wants a power of 2
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """``rope``: the batch's ``RotaryEmbedding.cos_sin``, shared by every layer."""
        return self.o_proj(self.attend(rope, self.qkv_proj(hidden), fb))

    def attend(
        self, rope: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """The projected ``qkv`` -> the attention output ``[T, heads * head_dim]`` (before
        ``o_proj``); the new tokens' K/V are written into the pool on the way."""
        fb.kv_pool.wait_loaded(self.layer_id)  # this layer of a host-tier load is in place
        t, q_size, kv_size = qkv.shape[0], self.qkv_proj.q_size, self.qkv_proj.kv_size
        if self.fused_rope and fused.available(qkv):  # [norm +] split + rotate (+ K/V write)
            heads = (self.num_heads, self.num_kv_heads, self.head_dim)
            norms = None
            if self.qk_norm:
                qn, kn = self.q_norm, self.k_norm
                norms = (qn.scale(qkv.dtype), kn.scale(qkv.dtype), qn.eps)
            target = fb.kv_pool.direct_write_target(self.layer_id)
            if target is None:
                q, k, v = fused.rope_split_qkv(qkv, *rope, *heads, norms=norms)
            else:
                k_buf, v_buf, k_scale, v_scale = target
                q = fused.rope_qkv_store(
                    qkv,
                    *rope,
                    *heads,
                    slots=fb.out_kv_slots,
                    k_buf=k_buf,
                    v_buf=v_buf,
                    k_scale=k_scale,
                    v_scale=v_scale,
                    norms=norms,
                )
                k = v = None  # in the pool already
        elif self.qk_norm:
            q, k, v = self.qkv_proj.split(qkv)
            q = self.rotary_emb.rotate(
                self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).flatten(1), rope
            )
            k = self.rotary_emb.rotate(
                self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).flatten(1), rope
            )
            v = v.contiguous()
        elif cpu_decode.serves(qkv) and qkv.stride(-1) == 1:  # one C++ call, in place
            cpu_decode.rope_inplace(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rope)
            q, k, v = self.qkv_proj.split(qkv)  # row-strided views of qkv
        else:  # q and k are adjacent in qkv: rotate them in one pass
            qk = self.rotary_emb.rotate(qkv[:, : q_size + kv_size], rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, q_size + kv_size :].contiguous()
        if k is not None and k.dim() != 2:  # (2-D already: no op to issue)
            k = k.reshape(t, kv_size)
        if q.dim() != 2:
            q = q.reshape(t, q_size)
        return fb.attn_backend.forward(q, k, v, self, fb)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        tp: TPGroup,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, options, rotary, tp)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp, options.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._stream_ok: dict[tuple, bool] = {}  # can_stream's weight checks per dtype/device

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns ``(mlp output, residual)``; their sum is this layer's output. A ``residual``
        of None means ``hidden`` is the whole output (the embeddings entering the first layer,
        or what the streaming path returns)."""
        if self._streams(hidden):
            return self._forward_streaming(rope, hidden, residual, fb), None
        hidden, residual = attention_half(self, rope, hidden, residual, fb)
        return self.mlp(hidden), residual

    def _streams(self, hidden: torch.Tensor) -> bool:
        """Whether this batch takes the weight-streaming path: a few rows on a GPU, one rank,
        dense weights of the activations' dtype without biases (``kernels/gemv.py``); q/k
        norms and rope run in ``attend`` as on the layer-by-layer path."""
        return hidden.is_cuda and self.can_stream(hidden)

    def can_stream(self, hidden: torch.Tensor) -> bool:
        """``_streams`` on any device the kernels run on (the Triton interpreter's included)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return streamable(self._stream_ok, hidden, linears)

    def _forward_streaming(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """The layer in four weight-streaming kernels plus attention: each norm is folded into
        the projection after it, silu*mul into the down projection, each residual add into the
        projection before it. Returns the layer's output (the residual stream)."""
        stream = stream_attention(self.self_attn, self.input_layernorm, rope, hidden, residual, fb)
        norm2, mlp = self.post_attention_layernorm, self.mlp
        gate_up = gemv.gemv_rmsnorm(stream, norm2.weight, norm2.eps, mlp.gate_up_proj.weight)
        return gemv.gemv_silu_mul(gate_up, mlp.down_proj.weight, residual=stream)


def streamable(cache: dict, hidden: torch.Tensor, linears: tuple) -> bool:
    """Whether ``hidden`` (a few rows) may take the weight-streaming kernels of
    ``kernels/gemv.py`` through ``linears``: few enough rows, the kernels on, one rank, dense
    weights of the activations' dtype, no biases. The weight checks are kept in ``cache`` per
    dtype and device (fixed once the weights are loaded)."""
    if hidden.shape[0] > gemv.MAX_ROWS or not gemv.ENABLED:
        return False
    key = (hidden.dtype, hidden.device)
    known = cache.get(key)
    if known is None:
        known = cache[key] = all(
            getattr(m, "tp", None) is None or m.tp.size == 1  # no collective after it
            for m in linears
        ) and all(
            m.bias is None and "forward" not in m.__dict__ and gemv.supported(hidden, m.weight)
            for m in linears
        )
    return known


def attention_half(
    layer: nn.Module,
    rope: tuple[torch.Tensor, torch.Tensor],
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    fb: ForwardBatch,
    stream: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's input norm, attention and post-attention norm (``layer``'s
    ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``): returns the MLP's input
    and the residual stream. ``stream``: the norm and residual add folded into the projections
    (:func:`stream_attention`)."""
    if stream:
        residual = stream_attention(
            layer.self_attn, layer.input_layernorm, rope, hidden, residual, fb
        )
        return layer.post_attention_layernorm(residual), residual
    if residual is None:
        residual, hidden = hidden, layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm.add_and_norm(hidden, residual)
    hidden = layer.self_attn(rope, hidden, fb)
    return layer.post_attention_layernorm.add_and_norm(hidden, residual)


def stream_attention(
    attn: LlamaAttention,
    norm: RMSNorm,
    rope: tuple[torch.Tensor, torch.Tensor],
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    fb: ForwardBatch,
) -> torch.Tensor:
    """A decoder layer's attention half in two weight-streaming kernels plus attention: ``norm``
    folded into the QKV projection, the residual add into the O projection (q/k norms and rope
    run in ``attend``). ``hidden + residual`` is the layer's input (``residual`` None: ``hidden``
    alone); returns the residual stream after attention."""
    stream = hidden if residual is None else hidden + residual
    qkv = gemv.gemv_rmsnorm(stream, norm.weight, norm.eps, attn.qkv_proj.weight)
    out = attn.attend(rope, qkv, fb)
    return gemv.gemv(out, attn.o_proj.weight, residual=stream)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, options: DecoderOptions, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.context_length, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            self.make_layer(config, i, options, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_layer(
        self, config: ModelConfig, layer_id: int, options: DecoderOptions, tp: TPGroup
    ) -> nn.Module:
        """Decoder layer ``layer_id`` (families with other layers override this)."""
        return LlamaDecoderLayer(config, layer_id, options, self.rotary_emb, tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb.cos_sin(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, fb)
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Contract shared by every architecture: see ``forward``, ``compute_logits``, ``load_weights``.

    ``tp``: this rank's tensor-parallel group (default: a single rank). Every rank builds only
    its slices, loads only them, and returns full-vocabulary logits from ``compute_logits``.
    ``weight_map``: how the family's checkpoint names map onto the parameters.
    """

    weight_map: WeightMap = LLAMA_WEIGHTS

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        tp = tp or TPGroup.single()
        self.tp = tp
        self.check_config(config)
        self.config = config
        with torch.device(device), default_dtype(dtype):
            self.model = self.build_model(config, tp)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self._int4_step: Int4StepRunner | None | bool = False  # False: not looked at yet
        # (hidden, logits) of the last forward when the int4 step computed its logits
        self._step_logits: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Refuses, naming the option, a checkpoint whose options this class does not implement."""
        hidden_act = getattr(config.hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(
                f"{config.architecture}: hidden_act {hidden_act!r} is not supported (only silu)"
            )
        if getattr(config.hf_config, "use_sliding_window", False):
            raise ValueError(f"{config.architecture}: sliding-window attention is not supported")

    def build_model(self, config: ModelConfig, tp: TPGroup) -> nn.Module:
        """The decoder stack (embedding, layers, final norm) under ``self.model``."""
        return LlamaModel(config, self.decoder_options(config), tp)

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        bias = bool(getattr(config.hf_config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config.hf_config, "mlp_bias", False))
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` int64 -> hidden states ``[T, hidden]`` after the final norm."""
        self._step_logits = None
        if input_ids.device.type == "cpu" and fb.mode.is_decode:
            step = self.int4_step()
            batch = step.serves(input_ids, fb) if step is not None else None
            if batch is not None:  # every layer (and the LM head) in one C++ call
                hidden, logits = step.forward(input_ids, positions, fb, batch)
                self._step_logits = None if logits is None else (hidden, logits)
                return hidden
        return self.model(input_ids, positions, fb)

    def int4_step(self) -> Int4StepRunner | None:
        """The CPU decode step of an int4 model (``srt/models/int4_step.py``), None where its
        layers do not qualify; looked at on first use (int4 layers are set after loading)."""
        if self._int4_step is False:
            self._int4_step = Int4StepRunner.for_model(self.model, self.lm_head)
        return self._int4_step

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 (those the int4 step computed with
        ``hidden``, when it is that step's output)."""
        stashed, self._step_logits = self._step_logits, None
        if stashed is not None and stashed[0] is hidden:
            return stashed[1]
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fills every parameter from ``(checkpoint name, tensor)`` pairs with Hugging Face names."""
        params = dict(self.named_parameters())
        loaded: dict[str, set] = {}
        for ckpt_name, tensor in weights:
            if self.weight_map.is_ignored(ckpt_name):
                continue
            if ckpt_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for name, shard_id, part in self.weight_targets(ckpt_name, tensor):
                if name not in params:
                    raise ValueError(
                        f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}"
                    )
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, part) if shard_id is None else loader(param, part, shard_id)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from e
                loaded.setdefault(name, set()).add(shard_id)
        if "lm_head.weight" in params and "lm_head.weight" not in loaded:
            self.lm_head.tie_to(self.model.embed_tokens)  # checkpoints without lm_head share it
            loaded["lm_head.weight"] = {None}
        missing = self.weight_map.missing(params, loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(
                f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}"
            )

    def weight_targets(
        self, ckpt_name: str, tensor: Any
    ) -> list[tuple[str, str | int | None, Any]]:
        """Where a checkpoint tensor goes: ``(parameter name, shard id or None, tensor)`` for each
        piece (the seam for checkpoints that fuse what we keep apart, or the reverse).
        ``tensor`` may be a lazy safetensors slice; a piece may be a slice of it."""
        name, shard_id = self.weight_map.param_name(ckpt_name)
        return [(name, shard_id, tensor)]

    def checkpoint_tensor(self, ckpt_name: str) -> torch.Tensor:
        """The running weight a checkpoint tensor of Hugging Face name ``ckpt_name`` was loaded
        into (a view: the rows of a merged projection; the embedding for a tied
        ``lm_head.weight``). ``KeyError`` naming an example when the model has no such tensor."""
        name, shard_id = self.weight_map.param_name(ckpt_name)
        params = dict(self.named_parameters(remove_duplicate=False))
        if self.weight_map.is_ignored(ckpt_name) or name not in params:
            raise KeyError(
                f"the model has no weight named {ckpt_name!r} (names are the checkpoint's, such "
                "as 'model.layers.0.self_attn.q_proj.weight' or 'model.embed_tokens.weight')"
            )
        weight = params[name].data
        if shard_id is None:
            return weight
        merged = self.get_submodule(name.rsplit(".", 1)[0])
        if hasattr(merged, "shard_view"):  # expert stacks: one expert's rows
            return merged.shard_view(shard_id)
        index = merged.SHARDS.index(shard_id) if isinstance(shard_id, str) else shard_id
        offset = sum(merged.output_sizes[:index])
        return weight.narrow(0, offset, merged.output_sizes[index])
