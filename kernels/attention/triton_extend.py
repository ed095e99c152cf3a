"""Paged extend (prefill on top of a cached prefix) attention in Triton.

One launch serves every request of the batch, whatever its prefix and extend lengths: the grid
is ``[B, num_heads, cdiv(max_extend_len, BLOCK_M)]`` and a program whose block of query rows lies
past its request's extend length exits at once. Each program reads the request's K/V (prefix and
new tokens alike, the new ones having just been written to the pool) through ``req_to_token``
and applies the causal mask ``kv_pos <= prefix_len + row`` (and, with a sliding window W,
``kv_pos > prefix_len + row - W``, starting its loop at the block's first visible key), with an
fp32 online softmax.
fp8 K/V are dequantised in registers as in ``triton_decode``; so are sinks (one logit per head in
each row's softmax denominator) added when a row's softmax is finished.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.attention.triton_decode import LOG2E, _tanh, _with_sink, sink_logits


@triton.jit
def _extend_kernel(
    q_ptr,  # [T, num_heads * head_dim]
    k_ptr,  # [num_slots, kv_heads, head_dim]
    v_ptr,
    out_ptr,  # [T, num_heads * head_dim]
    req_to_token_ptr,  # [num_req_slots, max_context_len] int64
    req_slots_ptr,  # [B] int
    prefix_lens_ptr,  # [B] int32
    extend_lens_ptr,  # [B] int32
    extend_starts_ptr,  # [B] int32: first token row of each request in q
    stride_q_tok,
    stride_out_tok,
    stride_kv_slot,
    stride_kv_head,
    stride_r2t_row,
    qk_scale_log2,  # softmax scale * log2(e) * k_scale
    v_scale,  # dequantisation scale of V (1.0 unless the pool is fp8)
    window,  # a row at position i sees keys i - window < j <= i; 0: all of j <= i
    cap_log2,  # soft-cap of the scores times log2(e)
    sinks_ptr,  # [num_heads] fp32 sink logits when HAS_SINKS
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    bid = tl.program_id(0)
    head = tl.program_id(1)
    mblk = tl.program_id(2)
    extend_len = tl.load(extend_lens_ptr + bid)
    if mblk * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + bid)
    tok_start = tl.load(extend_starts_ptr + bid).to(tl.int64)
    req_row = tl.load(req_slots_ptr + bid).to(tl.int64)
    kv_head = head // GROUP

    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < extend_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + (tok_start + rows)[:, None] * stride_q_tok + head * HEAD_DIM + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix_len + rows  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_end = prefix_len + tl.minimum((mblk + 1) * BLOCK_M, extend_len)
    # with a window, the block's first row sees nothing before its own window
    kv_start = tl.where(window > 0, tl.maximum(prefix_len + mblk * BLOCK_M - window + 1, 0), 0)
    kv_start = kv_start // BLOCK_N * BLOCK_N
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = pos < kv_end
        slots = tl.load(req_to_token_ptr + req_row * stride_r2t_row + pos, mask=mask_n, other=0)
        kv_off = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(tl.float32)  # the scale is folded into qk_scale_log2
        k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        if SOFTCAP:
            qk = cap_log2 * _tanh(qk / cap_log2)
        allowed = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if window > 0:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a row whose window starts past this tile has seen no key yet: keep its sums at 0
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(tl.float32)  # the scale is applied to the output
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # every real row sees at least its own key; padding rows past a window may see none
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head + tl.zeros([BLOCK_M], dtype=tl.int32))
        out = _with_sink(acc * v_scale, m_i, l_i, sink)
    else:
        out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(
        out_ptr + (tok_start + rows)[:, None] * stride_out_tok + head * HEAD_DIM + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend_len: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scaling: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens' queries ``q`` ``[T, num_heads * head_dim]`` over
    each request's prefix and new tokens, all read from the pool through ``req_to_token``.
    fp8 K/V buffers are dequantised in the kernel with ``k_scale``/``v_scale`` (see
    ``triton_decode``). ``window`` > 0: a row at position i sees keys ``i - window < j <= i``;
    ``softcap`` > 0: scores become ``softcap * tanh(score / softcap)``; ``sinks``
    (``[num_heads]``): one more logit per head in each row's denominator. ``out``: where to write (q's shape and dtype, rows may be a view)."""
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, "num_heads must be a multiple of num_kv_heads"
    assert k_buf.stride(-1) == 1 and q.stride(-1) == 1, "K/V and q need a contiguous last dim"
    out = torch.empty_like(q) if out is None else out
    batch = req_slots.shape[0]
    if batch == 0 or max_extend_len == 0:
        return out
    cfg = _extend_config(q, head_dim)
    cfg["KV_FP8"] = k_buf.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    grid = (batch, num_heads, triton.cdiv(max_extend_len, cfg["BLOCK_M"]))
    sink_arg = sink_logits(sinks, extend_lens)
    _extend_kernel[grid](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_slots,
        prefix_lens,
        extend_lens,
        extend_starts,
        q.stride(0),
        out.stride(0),
        k_buf.stride(0),
        k_buf.stride(1),
        req_to_token.stride(0),
        scaling * LOG2E * k_scale,
        v_scale,
        window,
        softcap * LOG2E,
        sink_arg,
        HEAD_DIM=head_dim,
        GROUP=group,
        SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None,
        **cfg,
    )
    return out


def _extend_config(q: torch.Tensor, head_dim: int) -> dict:
    interpreted = q.device.type == "cpu"
    wide = q.dtype == torch.float32 or interpreted
    block = 32 if wide or head_dim > 128 else 64
    cfg = dict(
        BLOCK_M=block,
        BLOCK_N=block,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=interpreted,
        DOT_PRECISION="ieee" if wide else "tf32",
    )
    if not interpreted:
        cfg.update(num_warps=4, num_stages=2)
    return cfg
