"""Fused elementwise kernels of the decoder layer (Triton): one kernel where torch runs several.

At batch 1 a decode step of an 8B model is a chain of about a thousand kernels; the small
elementwise ones (RMSNorm alone is seven torch ops in bf16) cost more in launch gaps than in
memory traffic. These kernels do each job in one pass, one program per token row:

- ``rmsnorm(x, w, eps)`` and ``add_rmsnorm(x, residual, w, eps)`` (returns the normed sum and
  the sum), rounded like the torch reference: the sum and the normalised value are rounded to
  the input dtype before the weight multiply;
- ``rope_split_qkv(qkv, cos, sin, ...)``: splits the fused QKV projection into contiguous q, k,
  v and rotates q and k (neox halves) in fp32, rounding once;
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


def _rope_split_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    stride_qkv,
    stride_cs,
    num_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
):
    """Program (token, head) over the H + 2*KVH heads of one token's qkv row."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(qkv_ptr + row * stride_qkv + head * HEAD_DIM + d)
    if head < num_heads + num_kv_heads:
        swapped = tl.load(qkv_ptr + row * stride_qkv + head * HEAD_DIM + (d + HALF) % HEAD_DIM)
        cos = tl.load(cos_ptr + row * stride_cs + d).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_cs + d).to(tl.float32)
        y = (x.to(tl.float32) * cos + swapped.to(tl.float32) * sin).to(x.dtype)
        if head < num_heads:
            tl.store(q_ptr + row * num_heads * HEAD_DIM + head * HEAD_DIM + d, y)
        else:
            tl.store(k_ptr + row * num_kv_heads * HEAD_DIM + (head - num_heads) * HEAD_DIM + d, y)
    else:
        tl.store(
            v_ptr
            + row * num_kv_heads * HEAD_DIM
            + (head - num_heads - num_kv_heads) * HEAD_DIM
            + d,
            x,
        )


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
        {"rmsnorm": _rmsnorm_kernel, "rope": _rope_split_kernel, "silu_mul": _silu_mul_kernel}[name]
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


def rope_split_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv`` ``[T, (H + 2*KVH) * d]`` -> contiguous ``q`` ``[T, H*d]``, ``k``, ``v``
    ``[T, KVH*d]`` with q and k rotated: ``x * cos + swap_halves(x) * sin`` where ``cos`` and
    ``sin`` are ``[T, d]`` (``sin`` carries the minus sign on its first half)."""
    _check_rows(qkv, "qkv")
    t = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv has {qkv.shape[1]} columns, expected {(num_heads + 2 * num_kv_heads) * head_dim}"
        )
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for the fused rope, got {head_dim}")
    cos, sin = cos.reshape(t, head_dim), sin.reshape(t, head_dim)
    q = qkv.new_empty(t, num_heads * head_dim)
    k = qkv.new_empty(t, num_kv_heads * head_dim)
    v = qkv.new_empty(t, num_kv_heads * head_dim)
    if t:
        _jit("rope")[(t, num_heads + 2 * num_kv_heads)](
            qkv,
            cos,
            sin,
            q,
            k,
            v,
            qkv.stride(0),
            cos.stride(0),
            num_heads,
            num_kv_heads,
            HEAD_DIM=head_dim,
            HALF=head_dim // 2,
        )
    return q, k, v


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
