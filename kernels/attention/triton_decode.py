"""Paged decode attention in Triton: one query token per request over its cached K/V.

Two passes (split-K, "flash decoding"):

1. ``_decode_partial_kernel``, grid ``[B, kv_heads, num_splits]``: each program takes one KV head
   with all the query heads of its group (GQA) and one contiguous slice of the request's
   sequence, reads the K/V slots through ``req_to_token``, and keeps an online softmax in fp32.
   It writes the slice's normalised output and its log-sum-exp (base 2).
2. ``_decode_merge_kernel``, grid ``[B, num_heads]``: merges the slices by their log-sum-exp.
   With one split (large batches) the first pass writes the output itself and this one is
   skipped (0.2 ms of a 17 ms step at batch 256 on the H200).

FP8 KV: the buffers may be float8 (values / k_scale, / v_scale); ``k_scale`` is folded into the
softmax scale (q.k * scale * k_scale) and the normalised output is multiplied by ``v_scale``, so
no dequantised copy is ever made. How a loaded fp8 tile reaches the tensor cores is
``FP8_DOT``: 0 converts it to float32 and then to q's dtype; 1 converts it to q's dtype
directly; 2 converts it to float16 (one instruction per two values on sm_89+) and does both
dots in float16, with q pre-multiplied by the softmax scale and saturated to the float16 range.
float16 holds every e4m3/e5m2 value exactly, and its 10-bit mantissa rounds q and p more finely
than bfloat16's 7. ``_decode_config`` uses 0, the path timed on the H200 so far;
``srt/bench/decode_tiles.py`` times all three (``tiles={"FP8_DOT": ...}`` selects one).

The number of splits depends only on the batch size and the layer's shape, never on sequence
lengths, and no length is read on the host: the launch is safe to capture in a CUDA graph.

Sliding window: the splits cover only the last ``window`` positions of each sequence. Soft-cap:
the base-2 scores are capped at ``softcap * log2(e)``, the same as capping the natural scores.
Sinks (gpt-oss): one logit per head joins the softmax's denominator and nothing of the values;
added once per head where the slices are merged (the first pass when there is one slice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _decode_partial_kernel(
    q_ptr,  # [B, num_heads * head_dim]
    k_ptr,  # [num_slots, kv_heads, head_dim]
    v_ptr,
    req_to_token_ptr,  # [num_req_slots, max_context_len] int64
    req_slots_ptr,  # [B] int
    seq_lens_ptr,  # [B] int
    part_o_ptr,  # [B, num_heads, NUM_SPLITS, head_dim] fp32
    part_lse_ptr,  # [B, num_heads, NUM_SPLITS] fp32 (base 2)
    out_ptr,  # [B, num_heads * head_dim]: written here directly when NUM_SPLITS == 1
    stride_out_tok,
    stride_q_tok,
    stride_kv_slot,
    stride_kv_head,
    stride_r2t_row,
    qk_scale_log2,  # softmax scale * log2(e) * k_scale
    v_scale,  # dequantisation scale of V (1.0 unless the pool is fp8)
    window,  # keys seen (the last `window` of the sequence); 0: all
    cap_log2,  # soft-cap of the scores times log2(e) (scores are in base 2 here)
    sinks_ptr,  # [num_heads] fp32 sink logits (natural units) when HAS_SINKS
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_DOT: tl.constexpr,  # 0: fp8 -> fp32 -> q's dtype; 1: fp8 -> q's dtype; 2: fp16 dots
):
    bid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + bid).to(tl.int32)
    req_row = tl.load(req_slots_ptr + bid).to(tl.int64)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # first key seen
    split_len = tl.cdiv(seq_len - first, NUM_SPLITS)
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    mask_h = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + bid * stride_q_tok + heads[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    if FP8_DOT == 2:  # (fp8 KV only) the scale goes into q once; fp16 saturates, bf16 not
        q = q.to(tl.float32) * qk_scale_log2
        q = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        slots = tl.load(req_to_token_ptr + req_row * stride_r2t_row + pos, mask=mask_n, other=0)
        kv_off = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            if FP8_DOT == 0:
                k = k.to(tl.float32)  # the scale is folded into qk_scale_log2
        k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if FP8_DOT != 2:
            qk = qk * qk_scale_log2
        if SOFTCAP:
            qk = cap_log2 * _tanh(qk / cap_log2)
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            if FP8_DOT == 0:
                v = v.to(tl.float32)  # the scale is applied to the output
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    out = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    if NUM_SPLITS == 1:  # the whole sequence: this is the result (what the merge would give)
        if HAS_SINKS:
            out = _with_sink(acc * v_scale, m_i, l_i, tl.load(sinks_ptr + heads, mask=mask_h))
        tl.store(
            out_ptr + bid * stride_out_tok + heads[:, None] * HEAD_DIM + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        row = (bid * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(
            part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            out,
            mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(part_lse_ptr + row, lse, mask=mask_h)


@triton.jit
def _tanh(x):
    """tanh through exp (the interpreter and every GPU have it); saturates to +-1."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _with_sink(acc, m_i, l_i, sink):
    """The normalised output of an online softmax (``acc`` and ``l_i`` relative to the base-2
    running max ``m_i``, ``[rows]``) whose denominator also holds ``exp(sink)`` (``sink``
    ``[rows]``, natural units): ``acc / (l + e^sink)`` in the max's frame, so a row with no key
    (``m_i`` -inf, ``acc`` 0) gives 0."""
    sink2 = sink * 1.4426950408889634
    m_f = tl.maximum(m_i, sink2)
    keep = tl.exp2(m_i - m_f)
    den = l_i * keep + tl.exp2(sink2 - m_f)
    return acc * (keep / den)[:, None]


@triton.jit
def _decode_merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,  # [B, num_heads * head_dim]
    stride_out_tok,
    sinks_ptr,  # [num_heads] fp32 when HAS_SINKS
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    bid = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    base = (bid * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink2 = tl.load(sinks_ptr + head) * 1.4426950408889634
        m = tl.maximum(m, sink2)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(
        part_o_ptr + (base + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    num = tl.sum(w[:, None] * o, 0)
    den = tl.sum(w, 0)
    if HAS_SINKS:
        den += tl.exp2(sink2 - m)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(
        out_ptr + bid * stride_out_tok + head * HEAD_DIM + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scaling: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    tiles: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, num_heads * head_dim]`` over each request's first ``seq_lens[i]``
    cached tokens (slots ``req_to_token[req_slots[i], :seq_lens[i]]``); returns q's shape/dtype.
    An fp8 ``k_buf``/``v_buf`` holds values / ``k_scale`` (``v_scale``): loaded as fp8 and
    converted in registers, with ``k_scale`` folded into the softmax scale and ``v_scale``
    applied to the output. ``window`` > 0: only the last ``window`` keys of each request are
    read; ``softcap`` > 0: scores become ``softcap * tanh(score / softcap)``; ``sinks``
    (``[num_heads]``): one more logit per head in each softmax's denominator. ``tiles`` overrides the chosen tile settings (``BLOCK_N``,
    ``num_stages``, ``num_warps``; for ``srt/bench/decode_tiles.py``). ``out``: where to write
    (q's shape and dtype, rows may be a view)."""
    batch = q.shape[0]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, "num_heads must be a multiple of num_kv_heads"
    assert k_buf.stride(-1) == 1 and q.stride(-1) == 1, "K/V and q need a contiguous last dim"
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    direct = num_splits == 1  # one program per (request, KV head) writes `out` itself
    parts = (1, 1, 1) if direct else (batch, num_heads, num_splits)
    part_o = torch.empty((*parts, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty(parts, dtype=torch.float32, device=q.device)
    kv_fp8 = k_buf.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    cfg = _decode_config(q, head_dim, group, kv_fp8)
    cfg["KV_FP8"] = kv_fp8
    cfg.update(tiles or {})
    if not kv_fp8 or cfg["UPCAST"] or q.dtype == torch.float32:
        cfg["FP8_DOT"] = 0  # 1 and 2 are for fp8 KV with 16-bit q
    sinks = sink_logits(sinks, part_lse)
    _decode_partial_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_slots,
        seq_lens,
        part_o,
        part_lse,
        out,
        out.stride(0),
        q.stride(0),
        k_buf.stride(0),
        k_buf.stride(1),
        req_to_token.stride(0),
        scaling * LOG2E * k_scale,
        v_scale,
        window,
        softcap * LOG2E,
        sinks,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        GROUP=group,
        NUM_SPLITS=num_splits,
        SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not part_lse,
        **cfg,
    )
    if direct:
        return out
    _decode_merge_kernel[(batch, num_heads)](
        part_o,
        part_lse,
        out,
        out.stride(0),
        sinks,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_SINKS=sinks is not part_lse,
    )
    return out


def sink_logits(sinks: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The sink logits as the kernels read them (fp32, contiguous), or ``placeholder`` (any
    fp32 tensor of the launch, never read) when the layer has none."""
    if sinks is None:
        return placeholder
    return sinks.detach().to(torch.float32).contiguous()


def _decode_config(q: torch.Tensor, head_dim: int, group: int, kv_fp8: bool) -> dict:
    """Tile sizes and pipelining. On GPUs with >= 160 KiB of shared memory per block (A100,
    H100/H200) and head_dim <= 128, three stages of 64 tokens (bf16 KV) or 128 tokens (fp8 KV:
    the same bytes per tile); measured on the H200 (``srt/bench/decode_tiles.py``) at batch
    256 x 1,100 tokens, 32/8 heads of 128:
    0.355 -> 0.293 ms per layer with bf16 KV (3.25 -> 3.93 TB/s) and 0.344 -> 0.224 ms with fp8
    KV, against two stages of 64 tokens."""
    interpreted = q.device.type == "cpu"
    wide = q.dtype == torch.float32 or interpreted
    cfg = dict(
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=32 if wide or head_dim > 128 else 64,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=interpreted,
        DOT_PRECISION="ieee" if wide else "tf32",
        FP8_DOT=0,
    )
    if interpreted:
        return cfg
    cfg.update(num_warps=4, num_stages=2)
    if not wide and head_dim <= 128 and _large_shared_memory(q.device):
        cfg.update(num_stages=3, BLOCK_N=128 if kv_fp8 else 64)
    return cfg


_SHARED_MEMORY: dict[int, bool] = {}


def _large_shared_memory(device: torch.device) -> bool:
    """Whether the GPU has compute capability 8.0 or 9.x/10.x (>= 160 KiB of shared memory per
    block); consumer parts (8.6, 8.9, 12.x) have about 100 KiB."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED_MEMORY:
        major, minor = torch.cuda.get_device_capability(index)
        _SHARED_MEMORY[index] = (major, minor) == (8, 0) or major in (9, 10)
    return _SHARED_MEMORY[index]
