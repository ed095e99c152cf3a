"""Fused Mixture-of-Experts (Triton): tokens sorted by expert, one grouped GEMM per projection.

The contract is ``kernels/moe.py``'s (``fused_experts`` takes the same arguments as
``grouped_experts`` and returns the same result). Three steps, no host sync (CUDA-graph safe):

1. **align** (torch ops): the ``T * k`` choices are sorted by expert and each expert's run is
   padded to a multiple of ``BLOCK_M``, so every block of ``BLOCK_M`` sorted rows belongs to one
   expert (``block_expert``; ``-1`` past the last used block). The padded length has a fixed
   upper bound, ``T * k + E * (BLOCK_M - 1)``, so the grid never depends on the routing.
2. **gate/up** kernel: program (row block, feature block) gathers its tokens' rows of ``x``,
   multiplies them by the block's expert's gate and up rows (two accumulators over the hidden
   dim) and writes ``silu(gate) * up`` into ``inter[sorted row]``.
3. **down** kernel: program (row block, hidden block) multiplies ``inter`` rows by the expert's
   ``down`` weight, scales each row by its choice's routing weight and writes the row of that
   choice in ``out [T * k, hidden]`` (float32); the ``k`` choices of a token are summed after.

Tiles (``BLOCK_M/N/K``) are chosen per shape (fewer rows per expert: smaller ``BLOCK_M``) and
cached. Choices of another rank's experts (``-1``) get no block; their rows stay zero.
Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
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
    """Whether the fused kernel serves this tensor (CUDA, with Triton installed)."""
    return triton is not None and x.is_cuda


def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    inter,
    hidden,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    TOP_K: tl.constexpr,
    NUM_CHOICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        choice = tl.load(sorted_ptr + rows)
        valid = choice < NUM_CHOICES
        token = tl.where(valid, choice // TOP_K, 0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = (k0 + ks) < hidden
            a = tl.load(
                x_ptr + token[:, None] * stride_xt + (k0 + ks)[None, :],
                mask=valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            wmask = k_ok[:, None] & col_ok[None, :]
            g = tl.load(
                w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None], mask=wmask, other=0.0
            )
            u = tl.load(
                w_base + (cols + inter)[None, :] * stride_wn + (k0 + ks)[:, None],
                mask=wmask,
                other=0.0,
            )
            acc_gate += tl.dot(a, g)
            acc_up += tl.dot(a, u)
        y = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & col_ok[None, :],
        )


def _down_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    weights_ptr,
    hidden,
    inter,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    NUM_CHOICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        choice = tl.load(sorted_ptr + rows)
        valid = choice < NUM_CHOICES
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = (k0 + ks) < inter
            a = tl.load(
                a_ptr + rows.to(tl.int64)[:, None] * stride_at + (k0 + ks)[None, :],
                mask=valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            acc += tl.dot(a, w)
        scale = tl.load(weights_ptr + tl.where(valid, choice, 0), mask=valid, other=0.0)
        acc = acc * scale[:, None]
        dst = tl.where(valid, choice, 0).to(tl.int64)
        tl.store(
            out_ptr + dst[:, None] * stride_ot + cols[None, :],
            acc,
            mask=valid[:, None] & col_ok[None, :],
        )


@functools.cache
def _jit(name: str):
    return triton.jit({"gate_up": _gate_up_kernel, "down": _down_kernel}[name])


@functools.cache
def tiles(rows_per_expert: int, hidden: int, inter: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for a shape (cached): ``BLOCK_M`` follows the average
    rows an expert receives (16 for decode-sized batches, up to 64 for prefills)."""
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    block_n = 64 if min(hidden, inter) >= 64 else 32
    block_k = 64 if min(hidden, inter) >= 64 else 32
    return block_m, block_n, block_k


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_choices [padded] int32, block_expert [padded / block_m] int32)``: choice indices
    (into the flattened ``[T * k]``) grouped by expert, each expert's run padded to a multiple of
    ``block_m`` with the sentinel ``T * k``; the expert of every block, ``-1`` for unused blocks.
    Torch ops only, no host sync; choices ``< 0`` (other ranks' experts) are left out."""
    flat = topk_ids.reshape(-1).long()
    num_choices = flat.numel()
    device = flat.device
    padded_len = num_choices + num_experts * (block_m - 1)
    padded_len = -(-padded_len // block_m) * block_m
    local = flat >= 0
    key = torch.where(local, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded_counts, 0) - padded_counts  # [E]
    sorted_start = torch.cumsum(counts, 0) - counts  # [E] where each expert's run starts
    sorted_key = key[order]
    in_local = sorted_key < num_experts
    e = sorted_key.clamp(max=num_experts - 1)
    position = padded_start[e] + torch.arange(num_choices, device=device) - sorted_start[e]
    position = torch.where(in_local, position, padded_len)  # dropped by the scatter below
    sorted_choices = torch.full((padded_len + 1,), num_choices, dtype=torch.int32, device=device)
    sorted_choices.scatter_(0, position, order.to(torch.int32))
    block_start = torch.arange(0, padded_len, block_m, device=device)
    padded_end = torch.cumsum(padded_counts, 0)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_choices[:padded_len], block_expert


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """``kernels/moe.grouped_experts``'s contract, in two grouped GEMM launches."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    if down.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"down has shape {tuple(down.shape)}, expected {(num_experts, hidden, inter)}"
        )
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    x = x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    num_choices = num_tokens * top_k
    block_m, block_n, block_k = tiles(max(num_choices // num_experts, 1), hidden, inter)
    sorted_choices, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    inter_rows = x.new_empty(sorted_choices.numel(), inter)
    _jit("gate_up")[(num_blocks, triton.cdiv(inter, block_n))](
        x,
        gate_up,
        inter_rows,
        sorted_choices,
        block_expert,
        inter,
        hidden,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        inter_rows.stride(0),
        TOP_K=top_k,
        NUM_CHOICES=num_choices,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    out = torch.zeros(num_choices, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _jit("down")[(num_blocks, triton.cdiv(hidden, block_n))](
        inter_rows,
        down,
        out,
        sorted_choices,
        block_expert,
        weights,
        hidden,
        inter,
        inter_rows.stride(0),
        down.stride(0),
        down.stride(1),
        out.stride(0),
        NUM_CHOICES=num_choices,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
