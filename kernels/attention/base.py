"""The attention backend contract: ``plan`` once per batch, ``forward`` once per layer.

``plan(fb)`` reads the batch layout (request slots, prefix/extend/sequence lengths, the
request-to-token table) and prepares whatever index or metadata tensors the kernels need; it
runs on the scheduler's thread before the model's forward. ``forward(q, k, v, layer, fb)``
first writes the new tokens' K/V into the pool at ``fb.out_kv_slots`` and then returns the
attention output for the new tokens' queries over every cached token of their request
(the prefix plus the new tokens, causally).

Shapes: ``q`` is ``[T, num_heads * head_dim]``, ``k`` and ``v`` are
``[T, num_kv_heads * head_dim]``; the result is ``[T, num_heads * head_dim]`` in q's dtype.
Heads are grouped (GQA): query head h reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch


class AttentionLayer(Protocol):
    """What a backend needs to know about the layer it serves."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    name: str = "base"

    @abstractmethod
    def plan(self, fb) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, fb) -> torch.Tensor: ...
