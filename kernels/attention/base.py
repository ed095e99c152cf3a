"""The attention backend contract: ``plan`` once per batch, ``forward`` once per layer.

``plan(fb)`` reads the batch layout (request slots, prefix/extend/sequence lengths, the
request-to-token table) and prepares whatever index or metadata tensors the kernels need; it
runs on the scheduler's thread before the model's forward. ``forward(q, k, v, layer, fb)``
first writes the new tokens' K/V into the pool at ``fb.out_kv_slots`` (``store_kv``; ``k`` and
``v`` are None when the model's fused rope kernel has written them already) and then returns the
attention output for the new tokens' queries over every cached token of their request
(the prefix plus the new tokens, causally).

Shapes: ``q`` is ``[T, num_heads * head_dim]``, ``k`` and ``v`` are
``[T, num_kv_heads * head_dim]``; the result is ``[T, num_heads * head_dim]`` in q's dtype.
Heads are grouped (GQA): query head h reads KV head ``h // (num_heads // num_kv_heads)``.

Two optional layer attributes change the scores (``attention_window`` and ``logit_cap`` read
them, with the defaults for layers that lack them): ``sliding_window`` (an int W: a query at
position i sees the keys at positions ``i - W < j <= i``, W keys counting itself; None or 0: the
whole prefix) and ``logit_cap`` (a float c > 0: every score ``s = scaling * q.k`` becomes
``c * tanh(s / c)`` before the softmax; 0: none). The pool keeps every token either way, so a
cached prefix means the same K/V with or without a window (out-of-window K/V are not evicted).
A third, ``sinks`` (a ``[num_heads]`` tensor of this rank's heads, gpt-oss), adds one logit per
head to every query's softmax that takes probability mass but has no value (the softmax runs
over ``[scores, sink]`` and the sink's column is dropped); only backends whose
``supports_sinks`` is True serve such layers (:func:`check_backend_serves`).

CUDA graphs (decode only). A backend with ``supports_cuda_graph`` True implements three hooks,
and the graph runner never asks a backend by name:

1. ``init_cuda_graph_state(max_batch_size, max_num_tokens)`` once, before any capture: the
   backend allocates the fixed buffers its captured kernels will read (the graph state).
2. ``plan_for_capture(fb)`` on each bucket's static decode batch before that bucket is captured.
3. ``plan_for_replay(fb)`` on the same static batch (its tensors refilled in place, its host
   lists describing the new step) before every replay: it must only write into buffers the
   captured kernels already read, never allocate new ones the graph does not know.

A backend without graph support keeps the defaults: ``supports_cuda_graph`` False and hooks that
raise, so capturing it fails loudly instead of replaying stale metadata.
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


def attention_window(layer) -> int:
    """The layer's sliding window in keys (counting the query's own), 0 for full attention."""
    window = getattr(layer, "sliding_window", None) or 0
    if window < 0:
        raise ValueError(f"layer {layer.layer_id}: sliding_window must be positive, got {window}")
    return int(window)


def logit_cap(layer) -> float:
    """The layer's tanh soft-cap of the attention scores, 0.0 for none."""
    cap = getattr(layer, "logit_cap", None) or 0.0
    if cap < 0:
        raise ValueError(f"layer {layer.layer_id}: logit_cap must be positive, got {cap}")
    return float(cap)


def attention_sinks(layer) -> torch.Tensor | None:
    """The layer's per-head sink logits ``[num_heads]``, None for none."""
    return getattr(layer, "sinks", None)


def model_has_sinks(model) -> bool:
    """Whether any attention layer of ``model`` has sink logits."""
    return any(attention_sinks(m) is not None for m in model.modules() if hasattr(m, "layer_id"))


def check_backend_serves(backend: AttentionBackend, model) -> None:
    """Refuses (ValueError naming the backend) a model with attention sinks on a backend that
    cannot add them."""
    if backend.supports_sinks:
        return
    if model_has_sinks(model):
        raise ValueError(
            f"this model's attention has sinks (gpt-oss), which the {backend.name} attention "
            "backend does not implement; use --attention-backend triton (GPU) or torch"
        )


# (sliding window or 0, soft-cap or 0.0, softmax scale): what a backend that plans per
# batch (FlashInfer) must know of every layer before the first batch
AttentionVariant = tuple[int, float, float]


def attention_variant(layer) -> AttentionVariant:
    return attention_window(layer), logit_cap(layer), float(layer.scaling)


def attention_variants(model) -> list[AttentionVariant]:
    """The distinct variants of a model's attention layers (modules with ``layer_id`` and
    ``scaling``), sorted."""
    return sorted(
        {
            attention_variant(m)
            for m in model.modules()
            if hasattr(m, "layer_id") and hasattr(m, "scaling")
        }
    )


class AttentionBackend(ABC):
    name: str = "base"
    supports_cuda_graph: bool = False  # decode steps may be captured and replayed (see above)
    supports_sinks: bool = False  # layers with attention sinks (see above)

    @abstractmethod
    def plan(self, fb) -> None: ...

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, fb
    ) -> torch.Tensor: ...

    @staticmethod
    def store_kv(k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayer, fb) -> None:
        """Writes the new tokens' K/V into the pool, unless they are there already (None)."""
        if k is None or v is None:
            if (k is None) != (v is None):
                raise ValueError("k and v are both given or both already written")
            return
        kv_shape = (-1, layer.num_kv_heads, layer.head_dim)
        fb.kv_pool.set_kv(layer.layer_id, fb.out_kv_slots, k.view(kv_shape), v.view(kv_shape))

    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Allocates the buffers captured decode steps read (``max_num_tokens`` bounds the cached
        tokens of one captured batch)."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def plan_for_capture(self, fb) -> None:
        """Plans the static decode batch ``fb`` of one bucket before its graph is captured."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def plan_for_replay(self, fb) -> None:
        """Re-plans the static decode batch ``fb`` (refilled in place) before a replay."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")
