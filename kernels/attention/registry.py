"""Picks an attention backend by name (placeholder until the GPU backends land)."""

from __future__ import annotations

import torch

from radixlm.kernels.attention.base import AttentionBackend
from radixlm.kernels.attention.torch_backend import TorchAttentionBackend


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise ValueError(f"attention backend {name!r} is not available on {device}")
