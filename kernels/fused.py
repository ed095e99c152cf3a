"""Fused elementwise kernels of the decoder layer (Triton): one kernel where torch runs several.

At batch 1 a decode step of an 8B model is a chain of about a thousand kernels; the small
elementwise ones (RMSNorm alone is seven torch ops in bf16) cost more in launch gaps than in
memory traffic. These kernels do each job in one pass, one program per token row:

- ``rmsnorm(x, w, eps)`` and ``add_rmsnorm(x, residual, w, eps)`` (returns the normed sum and
  the sum), rounded like the torch reference: the sum and the normalised value are rounded to
  the input dtype before the weight multiply;
- ``rope_split_qkv(qkv, cos, sin, ...)``: splits the fused QKV projection into contiguous q, k,
  v and rotates q and k (neox halves) in fp32, rounding once (per-head q/k RMSNorm first where
  the model has it: ``norms``); ``rope_qkv_store`` does the same
  but writes k and v straight into the KV pool at the new tokens' slots (quantising for an fp8
  pool), so the attention backend has no K/V write left to do;
- ``silu_and_mul(x)``: ``silu(x[:, :n]) * x[:, n:]``.

They run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None
    tl = None


def available(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve this tensor (CUDA, with Triton installed)."""
    return triton is not None and x.is_cuda


def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's add
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def _rope_qkv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    stride_qkv,
    stride_cs,
    k_scale,
    v_scale,
    qn_ptr,
    kn_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STORE: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    NORM: tl.constexpr,
):
    """Program (token, part): part 0 rotates the token's q heads, part 1 its k heads, part 2
    copies its v heads, each as one [heads, head_dim] tile. Outputs are rows of contiguous
    ``[*, heads * head_dim]`` buffers: q's row is the token; k's and v's row is the token too,
    or with ``STORE`` its KV slot ``slots[token]`` in the pool (quantised with ``QUANT``:
    value / scale, saturated to +-FP8_MAX, as ``memory_pool.quantize_fp8``). With ``NORM``
    each q (k) head is RMS-normalised over ``HEAD_DIM`` and scaled by ``qn`` (``kn``) first,
    rounded as ``rmsnorm``, before the rotation."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    src = qkv_ptr + row * stride_qkv
    mask = (h < tl.where(part == 0, NUM_HEADS, NUM_KV_HEADS))[:, None]
    col0 = tl.minimum(part, 1) * (NUM_HEADS * HEAD_DIM) + tl.maximum(part - 1, 0) * (
        NUM_KV_HEADS * HEAD_DIM
    )
    tile = h[:, None] * HEAD_DIM + d[None, :]
    x = tl.load(src + col0 + tile, mask=mask, other=0.0)
    if part < 2:
        swapped = tl.load(
            src + col0 + h[:, None] * HEAD_DIM + ((d + HALF) % HEAD_DIM)[None, :],
            mask=mask,
            other=0.0,
        )
        if NORM:  # per-head RMSNorm (Qwen3, Gemma 3): one rstd per head serves both halves
            if part == 0:
                w = tl.load(qn_ptr + d).to(tl.float32)
                w_swapped = tl.load(qn_ptr + (d + HALF) % HEAD_DIM).to(tl.float32)
            else:
                w = tl.load(kn_ptr + d).to(tl.float32)
                w_swapped = tl.load(kn_ptr + (d + HALF) % HEAD_DIM).to(tl.float32)
            x32 = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / HEAD_DIM + eps)
            x = ((x32 * rstd[:, None]).to(x.dtype).to(tl.float32) * w[None, :]).to(x.dtype)
            swapped = (
                (swapped.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
                * w_swapped[None, :]
            ).to(x.dtype)
        cos = tl.load(cos_ptr + row * stride_cs + d).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_cs + d).to(tl.float32)
        x = (x.to(tl.float32) * cos[None, :] + swapped.to(tl.float32) * sin[None, :]).to(x.dtype)
    if part == 0:
        tl.store(q_ptr + row * (NUM_HEADS * HEAD_DIM) + tile, x, mask=mask)
    else:
        dst_row = row
        if STORE:
            dst_row = tl.load(slots_ptr + row).to(tl.int64)
        offs = dst_row * (NUM_KV_HEADS * HEAD_DIM) + tile
        if part == 1:
            if QUANT:
                y = tl.clamp(x.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
                tl.store(k_ptr + offs, y.to(k_ptr.dtype.element_ty), mask=mask)
            else:
                tl.store(k_ptr + offs, x.to(k_ptr.dtype.element_ty), mask=mask)
        else:
            if QUANT:
                y = tl.clamp(x.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
                tl.store(v_ptr + offs, y.to(v_ptr.dtype.element_ty), mask=mask)
            else:
                tl.store(v_ptr + offs, x.to(v_ptr.dtype.element_ty), mask=mask)


def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _jit(name: str):
    """Wraps a kernel on first use, so ``TRITON_INTERPRET`` is read then, not at import."""
    return triton.jit(
        {"rmsnorm": _rmsnorm_kernel, "rope": _rope_qkv_kernel, "silu_mul": _silu_mul_kernel}[name]
    )


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be 2-D with a contiguous last dim, got shape "
            f"{tuple(x.shape)} strides {x.stride()}"
        )


def _norm(x, residual, weight, eps):
    _check_rows(x, "x")
    t, n = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else out
    if residual is not None:
        _check_rows(residual, "residual")
    if t:
        res = residual if residual is not None else x
        _jit("rmsnorm")[(t,)](
            x,
            res,
            weight,
            out,
            summed,
            n,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            summed.stride(0),
            eps,
            HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(n),
        )
    return out, summed


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim of ``[T, n]``."""
    return _norm(x, None, weight, eps)[0]


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual), x + residual)``."""
    return _norm(x, residual, weight, eps)


def _check_qkv(qkv, num_heads, num_kv_heads, head_dim) -> None:
    _check_rows(qkv, "qkv")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv has {qkv.shape[1]} columns, expected {(num_heads + 2 * num_kv_heads) * head_dim}"
        )
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for the fused rope, got {head_dim}")


Norms = tuple[torch.Tensor, torch.Tensor, float]  # (q weight [d], k weight [d], eps)


def _check_norms(norms: Norms | None, head_dim: int) -> None:
    if norms is None:
        return
    for name, w in zip(("q", "k"), norms[:2], strict=True):
        if w.shape != (head_dim,) or not w.is_contiguous():
            raise ValueError(f"the {name} norm weight must be a contiguous [{head_dim}] tensor")


def _launch_rope(qkv, cos, sin, slots, q, k, v, k_scale, v_scale, dims, store, norms=None) -> None:
    num_heads, num_kv_heads, head_dim = dims
    t = qkv.shape[0]
    if not t:
        return
    qn, kn, eps = norms if norms is not None else (qkv, qkv, 0.0)
    cos, sin = cos.reshape(t, head_dim), sin.reshape(t, head_dim)
    quant = k.dtype in _FP8_MAX
    _jit("rope")[(t, 3)](
        qkv,
        cos,
        sin,
        slots,
        q,
        k,
        v,
        qkv.stride(0),
        cos.stride(0),
        float(k_scale),
        float(v_scale),
        qn,
        kn,
        float(eps),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        STORE=store,
        QUANT=quant,
        FP8_MAX=_FP8_MAX.get(k.dtype, 0.0),
        NORM=norms is not None,
        num_warps=4 if num_heads * head_dim <= 2048 else 8,
    )


_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def rope_split_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norms: Norms | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv`` ``[T, (H + 2*KVH) * d]`` -> contiguous ``q`` ``[T, H*d]``, ``k``, ``v``
    ``[T, KVH*d]`` with q and k rotated: ``x * cos + swap_halves(x) * sin`` where ``cos`` and
    ``sin`` are ``[T, d]`` (``sin`` carries the minus sign on its first half). ``norms``
    ``(q weight, k weight, eps)``: each q and k head is RMS-normalised first (per-head q/k
    norms), as ``rmsnorm`` of the head would."""
    _check_qkv(qkv, num_heads, num_kv_heads, head_dim)
    _check_norms(norms, head_dim)
    t = qkv.shape[0]
    q = qkv.new_empty(t, num_heads * head_dim)
    k = qkv.new_empty(t, num_kv_heads * head_dim)
    v = qkv.new_empty(t, num_kv_heads * head_dim)
    dims = (num_heads, num_kv_heads, head_dim)
    _launch_rope(qkv, cos, sin, q, q, k, v, 1.0, 1.0, dims, False, norms)
    return q, k, v


def rope_qkv_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    slots: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    norms: Norms | None = None,
) -> torch.Tensor:
    """:func:`rope_split_qkv` that writes the rotated k and the v of token ``i`` straight into
    the KV pool's row ``slots[i]`` of ``k_buf``/``v_buf`` (``[num_slots, KVH, d]``, contiguous;
    an fp8 buffer stores value / scale saturated to the format's range, as
    ``KVPool.set_kv``) and returns only ``q`` ``[T, H*d]``: one kernel instead of a split, a
    rotation and two indexed writes. ``norms`` as in :func:`rope_split_qkv`."""
    _check_qkv(qkv, num_heads, num_kv_heads, head_dim)
    _check_norms(norms, head_dim)
    for name, buf in (("k_buf", k_buf), ("v_buf", v_buf)):
        if not buf.is_contiguous() or tuple(buf.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be a contiguous [slots, {num_kv_heads}, {head_dim}] buffer, "
                f"got shape {tuple(buf.shape)}"
            )
    if slots.shape != (qkv.shape[0],):
        raise ValueError(f"slots must be [{qkv.shape[0]}], got {tuple(slots.shape)}")
    q = qkv.new_empty(qkv.shape[0], num_heads * head_dim)
    dims = (num_heads, num_kv_heads, head_dim)
    _launch_rope(qkv, cos, sin, slots, q, k_buf, v_buf, k_scale, v_scale, dims, True, norms)
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` ``[T, 2n]``, computed in fp32."""
    _check_rows(x, "x")
    t, n = x.shape[0], x.shape[1] // 2
    out = x.new_empty(t, n)
    if t:
        block = min(triton.next_power_of_2(n), 4096)
        _jit("silu_mul")[(t, triton.cdiv(n, block))](
            x, out, n, x.stride(0), out.stride(0), BLOCK=block
        )
    return out
