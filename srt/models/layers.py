"""Building blocks of the decoder models: norms, rotary embedding, linear layers, MLP, embeddings.

Every parameter that a checkpoint fills carries a ``weight_loader(param, tensor[, shard_id])``
attribute: merged layers (QKV, gate+up) know where each checkpoint tensor goes, so the model's
``load_weights`` only maps names. Parameters are created uninitialised (``torch.empty``); they
are meant to be filled from a checkpoint.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import fused

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Creates floating tensors in ``dtype`` inside the block (model construction only)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def copy_checked(dst: torch.Tensor, src: Any) -> None:
    """``dst.copy_(src)`` after a shape check; ``src`` may be a lazy safetensors slice (read
    whole here)."""
    if not isinstance(src, torch.Tensor):
        src = src[:]
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: Any) -> None:
    copy_checked(param.data, loaded)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size)  # [hidden]

    def scale(self, dtype: torch.dtype) -> torch.Tensor:
        """What the normalised value is multiplied by (the fused kernels take it)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.available(x):
            return fused.rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if x.dtype == torch.float32:  # one fused op: on a CPU each op costs its dispatch
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``."""
        if fused.available(x) and x.dim() == 2:
            return fused.add_rmsnorm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self.forward(summed), summed


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]`` float32 for plain, linear, Llama-3 or YaRN rope
    (YaRN also scales cos and sin: :func:`rope_attention_factor`)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {list(ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_band, blended, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    divided by ``factor``, those turning more than ``beta_fast`` times kept, a linear ramp
    between (over the dimension index; ``truncate`` rounds its ends outwards, as transformers)."""
    factor = float(scaling["factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's ``attention_factor`` (default
    ``0.1 * ln(factor) + 1``, or the ``mscale``/``mscale_all_dim`` ratio), 1 for the others."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(scaling["factor"])
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotates the two halves of each head) over the full head."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        scale = rope_attention_factor(scaling)
        # [max_positions, head_dim / 2] float32
        self.register_buffer("cos_cache", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * scale, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed sin)``, each ``[T, 1, head_dim]``: computed once per forward, used by
        every layer. ``signed sin`` is ``-sin`` on the first half so that one multiply-add
        rotates: ``x * cos + swap_halves(x) * signed_sin``."""
        cos = self.cos_cache[positions]
        sin = self.sin_cache[positions]
        return (
            torch.cat((cos, cos), -1).unsqueeze(1).to(dtype),
            torch.cat((-sin, sin), -1).unsqueeze(1).to(dtype),
        )

    def rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x`` ``[T, n*head_dim]`` (rows may be strided) -> rotated ``[T, n, head_dim]``, contiguous."""
        t, d = x.shape[0], self.head_dim
        heads = x.view(t, -1, d)
        swapped = heads.view(t, -1, 2, d // 2).flip(2).view(t, -1, d)
        cos, sin = cos_sin
        return torch.addcmul(heads * cos, swapped, sin)


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` ``[out_features, in_features]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(out_features)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (e.g. gate + up).

    Checkpoints store them separately; ``weight_loader(param, tensor, shard_id)`` copies shard
    ``shard_id`` (an index into ``output_sizes``) into its rows.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id])
        copy_checked(param.data.narrow(0, offset, self.output_sizes[shard_id]), loaded)


class QKVLinear(MergedLinear):
    """Query, key and value projections in one matmul; shard ids are ``"q"``, ``"k"``, ``"v"``."""

    SHARDS = ("q", "k", "v")

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ):
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:  # type: ignore[override]
        super().weight_loader(param, loaded, self.SHARDS.index(shard_id))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if fused.available(x) and x.dim() == 2:
        return fused.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = _param(vocab_size, hidden_size)  # [vocab, hidden]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; can share the input embedding's weight."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = _param(vocab_size, hidden_size)  # [vocab, hidden]

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32."""
        return F.linear(hidden, self.weight).float()
