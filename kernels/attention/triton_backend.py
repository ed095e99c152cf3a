"""Attention on Triton kernels (GPU; runs on CPU tensors under ``TRITON_INTERPRET=1``).

Same contract as the torch reference (see ``base.py``). The kernels read K/V slots through
``req_to_token`` directly, so every page size works and ``plan`` builds only small per-request
tensors. Decode references the batch's own ``req_slots``/``seq_lens`` tensors and reads no
length on the host, so a decode step can be captured in a CUDA graph: ``plan_for_capture`` on the
static batch once before capture, then refill those tensors in place; ``plan_for_replay`` only
checks that the batch is still the captured one's. An fp8 pool is read as is: the kernels
dequantise with the layer's static scales (Python floats, constants of a captured graph).

An extend batch whose last requests compute one new token each (the running requests' decode
rows of a mixed chunked-prefill step) runs those through the decode kernel and the rest through
the extend kernel: the extend kernel reads a request's K/V once per query head and fills one row
of a 64-row query tile, the decode kernel once per KV head for the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.attention.base import (
    AttentionBackend,
    AttentionLayer,
    attention_sinks,
    attention_window,
    logit_cap,
)
from radixlm.kernels.attention.triton_decode import decode_attention
from radixlm.kernels.attention.triton_extend import extend_attention

MAX_KV_SPLITS = 16


@dataclass
class _DecodePlan:
    req_to_token: torch.Tensor  # [num_req_slots, max_context_len] int64, device
    req_slots: torch.Tensor  # [B] int64, device
    seq_lens: torch.Tensor  # [B] int64, device


@dataclass
class _ExtendPlan:
    req_to_token: torch.Tensor  # [num_req_slots, max_context_len] int64, device
    req_slots: torch.Tensor  # [B] int64, device
    prefix_lens: torch.Tensor  # [B] int32, device
    extend_lens: torch.Tensor  # [B] int32, device
    extend_starts: torch.Tensor  # [B] int32, device: first row of each request in q
    max_extend_len: int
    # the batch's trailing requests of one new token each (the decode rows of a mixed chunked
    # prefill step), run through the decode kernel from q row `num_extend_tokens` on
    decode_tail: _DecodePlan | None = None
    num_extend_tokens: int = 0


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    supports_sinks = True

    def __init__(self, num_kv_splits: int | None = None):
        """``num_kv_splits`` fixes the decode split count; by default it is chosen from the batch
        size and the number of KV heads so that a decode step fills the GPU."""
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        self._num_kv_splits = num_kv_splits
        self._sm_count: int | None = None
        self._decode: _DecodePlan | None = None
        self._extend: _ExtendPlan | None = None

    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Nothing to preallocate: decode reads the static batch tensors it was planned with."""

    def plan_for_capture(self, fb) -> None:
        if not fb.mode.is_decode:
            raise ValueError("only decode batches can be captured in a CUDA graph")
        self.plan(fb)

    def plan_for_replay(self, fb) -> None:
        # the captured kernels read fb's req_slots/seq_lens tensors, refilled in place, so the
        # capture's plan still holds
        self.plan_for_capture(fb)

    def plan(self, fb) -> None:
        table = fb.req_to_token_pool.req_to_token
        if fb.mode.is_decode:
            self._decode = _DecodePlan(table, fb.req_slots, fb.seq_lens)
            self._extend = None
            return
        device = fb.req_slots.device
        lens = fb.extend_lens_cpu
        n = len(lens)  # requests [n:] form the decode tail
        while n > 0 and lens[n - 1] == 1:
            n -= 1
        tail = None
        if n < len(lens):
            tail = _DecodePlan(table, fb.req_slots[n:], fb.seq_lens[n:])
        starts, total = [], 0
        for ext in lens[:n]:
            starts.append(total)
            total += ext
        meta = torch.tensor([fb.prefix_lens_cpu[:n], lens[:n], starts], dtype=torch.int32)
        meta = meta.to(device, non_blocking=True)
        self._extend = _ExtendPlan(
            req_to_token=table,
            req_slots=fb.req_slots[:n],
            prefix_lens=meta[0],
            extend_lens=meta[1],
            extend_starts=meta[2],
            max_extend_len=max(lens[:n], default=0),
            decode_tail=tail,
            num_extend_tokens=total,
        )
        self._decode = None

    def forward(self, q, k, v, layer: AttentionLayer, fb) -> torch.Tensor:
        self.store_kv(k, v, layer, fb)
        k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
        k_scale, v_scale = fb.kv_pool.get_scales(layer.layer_id)  # static: safe in CUDA graphs
        dims = dict(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            scaling=layer.scaling,
            k_scale=k_scale,
            v_scale=v_scale,
            window=attention_window(layer),
            softcap=logit_cap(layer),
            sinks=attention_sinks(layer),
        )
        if fb.mode.is_decode:
            plan = self._decode
            assert plan is not None, "plan(fb) must run before forward for a decode batch"
            splits = self._splits(q.shape[0], layer.num_kv_heads, q.device)
            return decode_attention(
                q,
                k_buf,
                v_buf,
                plan.req_to_token,
                plan.req_slots,
                plan.seq_lens,
                num_splits=splits,
                **dims,
            )
        plan = self._extend
        assert plan is not None, "plan(fb) must run before forward for an extend batch"
        out = torch.empty_like(q)
        cut = plan.num_extend_tokens
        if cut:
            extend_attention(
                q[:cut],
                k_buf,
                v_buf,
                plan.req_to_token,
                plan.req_slots,
                plan.prefix_lens,
                plan.extend_lens,
                plan.extend_starts,
                plan.max_extend_len,
                out=out[:cut],
                **dims,
            )
        tail = plan.decode_tail
        if tail is not None:  # grouped heads, split KV: the decode kernel's strengths
            rows = q.shape[0] - cut
            decode_attention(
                q[cut:],
                k_buf,
                v_buf,
                tail.req_to_token,
                tail.req_slots,
                tail.seq_lens,
                num_splits=self._splits(rows, layer.num_kv_heads, q.device),
                out=out[cut:],
                **dims,
            )
        return out

    def _splits(self, batch: int, num_kv_heads: int, device: torch.device) -> int:
        if self._num_kv_splits is not None:
            return self._num_kv_splits
        if device.type != "cuda":
            return 2
        if self._sm_count is None:
            self._sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        programs = max(1, batch * num_kv_heads)
        return max(1, min(MAX_KV_SPLITS, -(-2 * self._sm_count // programs)))
