"""Attention on plain torch (the CPU path, and the reference on GPUs).

Decode gathers the batch's cached K/V once per layer into one ragged buffer (only real tokens, no
padding to the longest request) and runs one SDPA call per request over a view of it: on a CPU the
gather is the bandwidth cost, and padding a mixed-length batch to its longest request doubled it.

An fp8 pool (``kv_pool.get_scales``) is dequantised in the gather: only the gathered rows are
converted to q's dtype and multiplied by the layer's scale.

A layer's sliding window (``base.attention_window``) narrows each query's keys to its last W
positions (decode reads only those rows); a soft-capped layer (``base.logit_cap``) takes the
explicit float32 softmax path, since SDPA has no cap; so does a layer with attention sinks
(``base.attention_sinks``: one extra logit per head in the softmax, its column dropped).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from radixlm.kernels.attention.base import (
    AttentionBackend,
    AttentionLayer,
    attention_sinks,
    attention_window,
    logit_cap,
)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_sinks = True

    def __init__(self):
        self._kv_flat: torch.Tensor | None = None  # decode: every request's kv slots, concatenated
        self._kv_offsets: list[int] = []  # decode: request i's slots are _kv_flat[off[i]:off[i+1]]
        self._extend_rows: list[
            tuple[int, int, int, torch.Tensor]
        ] = []  # (start, prefix, ext, kv idx)

    def plan(self, fb) -> None:
        table = fb.req_to_token_pool.req_to_token
        if fb.mode.is_decode:
            lens = fb.seq_lens_cpu
            if fb.batch_size == 1:
                self._kv_flat = table[fb.req_slots_cpu[0], : lens[0]]
            else:
                max_len = max(lens)
                cols = torch.arange(max_len, device=fb.seq_lens.device)
                self._kv_flat = table[fb.req_slots, :max_len][cols[None, :] < fb.seq_lens[:, None]]
            self._kv_offsets = [0, *itertools.accumulate(lens)]
            return
        rows, start = [], 0
        for i, (p, e) in enumerate(zip(fb.prefix_lens_cpu, fb.extend_lens_cpu, strict=True)):
            rows.append((start, p, e, table[fb.req_slots_cpu[i], : p + e]))
            start += e
        self._extend_rows = rows

    def forward(self, q, k, v, layer: AttentionLayer, fb) -> torch.Tensor:
        self.store_kv(k, v, layer, fb)
        k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
        scales = fb.kv_pool.get_scales(layer.layer_id)
        if fb.mode.is_decode:
            return self._decode(q, k_buf, v_buf, scales, layer)
        return self._extend(q, k_buf, v_buf, scales, layer)

    def _decode(self, q, k_buf, v_buf, scales, layer) -> torch.Tensor:
        b, h, d = q.shape[0], layer.num_heads, layer.head_dim
        qh = q.view(b, 1, h, 1, d)
        kf = gather_rows(k_buf, self._kv_flat, q.dtype, scales[0])  # [sum(L), kv_heads, d]
        vf = gather_rows(v_buf, self._kv_flat, q.dtype, scales[1])
        out = torch.empty(b, 1, h, 1, d, dtype=q.dtype, device=q.device)
        offs, window = self._kv_offsets, attention_window(layer)
        for i in range(b):
            lo, hi = offs[i], offs[i + 1]
            if window:
                lo = max(lo, hi - window)
            out[i] = attend(
                qh[i], kf[lo:hi].transpose(0, 1)[None], vf[lo:hi].transpose(0, 1)[None], layer
            )
        return out.view(b, h * d)

    def _extend(self, q, k_buf, v_buf, scales, layer) -> torch.Tensor:
        out = torch.empty_like(q)
        h, d = layer.num_heads, layer.head_dim
        window = attention_window(layer)
        for start, prefix, ext, kv_index in self._extend_rows:
            qh = q[start : start + ext].view(ext, h, d).transpose(0, 1)[None]  # [1, H, ext, d]
            first = max(0, prefix - window + 1) if window else 0  # the first key any row sees
            kv_index = kv_index[first:]
            # [1, kv_heads, L, d]
            kh = gather_rows(k_buf, kv_index, q.dtype, scales[0]).transpose(0, 1)[None]
            vh = gather_rows(v_buf, kv_index, q.dtype, scales[1]).transpose(0, 1)[None]
            if prefix == 0 and not window:
                o = attend(qh, kh, vh, layer, causal=True)
            else:
                rows = torch.arange(ext, device=q.device)[:, None] + prefix
                cols = torch.arange(first, prefix + ext, device=q.device)[None, :]
                mask = cols <= rows
                if window:
                    mask &= cols > rows - window
                o = attend(qh, kh, vh, layer, mask=mask)
            out[start : start + ext] = o[0].transpose(0, 1).reshape(ext, h * d)
        return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayer,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of ``q`` ``[1, H, Lq, d]`` over ``k``/``v`` ``[1, kv_heads, Lk, d]``; ``mask``
    ``[Lq, Lk]`` bool (True: attend) or ``causal``. SDPA, or with the layer's soft-cap an
    explicit softmax in float32 (also for a layer with attention sinks)."""
    gqa = layer.num_heads != layer.num_kv_heads
    cap = logit_cap(layer)
    sinks = attention_sinks(layer)
    if not cap and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=layer.scaling, enable_gqa=gqa
        )
    if gqa:
        group = layer.num_heads // layer.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scaling
    if cap:
        scores = torch.tanh(scores / cap) * cap
    if causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def gather_rows(
    buf: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    """Rows ``index`` of a pool buffer ``[slots, kv_heads, d]`` in ``dtype``; an fp8 buffer's rows
    are dequantised (times ``scale``) after the gather, never the whole buffer."""
    if buf.dtype not in FP8_DTYPES:
        return buf.index_select(0, index).to(dtype)
    # gather the bytes: index_select of float8 is not implemented on every device
    rows = buf.view(torch.uint8).index_select(0, index).view(buf.dtype).to(dtype)
    return rows if scale == 1.0 else rows.mul_(scale)
