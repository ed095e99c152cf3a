"""Reference attention on plain torch (CPU and GPU): per-request prefill, padded batched decode."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels.attention.base import AttentionBackend, AttentionLayer


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self):
        self._kv_index: torch.Tensor | None = None  # decode: [B, max_len] kv slots (0 = padding)
        self._mask: torch.Tensor | None = None  # decode: [B, 1, 1, max_len] bool, None if B == 1
        self._extend_rows: list[tuple[int, int, int, torch.Tensor]] = []  # (start, prefix, ext, kv idx)

    def plan(self, fb) -> None:
        table = fb.req_to_token_pool.req_to_token
        if fb.mode.is_decode:
            max_len = max(fb.seq_lens_cpu)
            self._kv_index = table[fb.req_slots, :max_len]
            if fb.batch_size == 1:
                self._mask = None
            else:
                cols = torch.arange(max_len, device=fb.seq_lens.device)
                self._mask = (cols[None, :] < fb.seq_lens[:, None])[:, None, None, :]
            return
        rows, start = [], 0
        for i, (p, e) in enumerate(zip(fb.prefix_lens_cpu, fb.extend_lens_cpu)):
            rows.append((start, p, e, table[fb.req_slots_cpu[i], : p + e]))
            start += e
        self._extend_rows = rows

    def forward(self, q, k, v, layer: AttentionLayer, fb) -> torch.Tensor:
        fb.kv_pool.set_kv(layer.layer_id, fb.out_kv_slots, k.view(-1, layer.num_kv_heads, layer.head_dim),
                          v.view(-1, layer.num_kv_heads, layer.head_dim))
        k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
        if fb.mode.is_decode:
            return self._decode(q, k_buf, v_buf, layer)
        return self._extend(q, k_buf, v_buf, layer)

    def _decode(self, q, k_buf, v_buf, layer) -> torch.Tensor:
        b = q.shape[0]
        qh = q.view(b, layer.num_heads, 1, layer.head_dim)
        kh = k_buf[self._kv_index].transpose(1, 2).to(q.dtype)  # [B, kv_heads, L, d]
        vh = v_buf[self._kv_index].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=self._mask, scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return o.reshape(b, layer.num_heads * layer.head_dim)

    def _extend(self, q, k_buf, v_buf, layer) -> torch.Tensor:
        out = torch.empty_like(q)
        h, d = layer.num_heads, layer.head_dim
        for start, prefix, ext, kv_index in self._extend_rows:
            qh = q[start : start + ext].view(ext, h, d).transpose(0, 1)[None]  # [1, H, ext, d]
            kh = k_buf[kv_index].transpose(0, 1)[None].to(q.dtype)  # [1, kv_heads, L, d]
            vh = v_buf[kv_index].transpose(0, 1)[None].to(q.dtype)
            if prefix == 0:
                o = F.scaled_dot_product_attention(
                    qh, kh, vh, is_causal=True, scale=layer.scaling, enable_gqa=h != layer.num_kv_heads
                )
            else:
                rows = torch.arange(ext, device=q.device)[:, None] + prefix
                mask = torch.arange(prefix + ext, device=q.device)[None, :] <= rows
                o = F.scaled_dot_product_attention(
                    qh, kh, vh, attn_mask=mask, scale=layer.scaling, enable_gqa=h != layer.num_kv_heads
                )
            out[start : start + ext] = o[0].transpose(0, 1).reshape(ext, h * d)
        return out
