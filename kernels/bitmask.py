"""Applies a packed vocabulary bitmask to logits in place: disallowed tokens become ``-inf``.

Layout (shared by outlines-core, llguidance and XGrammar): ``bitmask`` is int32
``[rows, ceil(V / 32)]`` and token ``t`` is allowed when bit ``t % 32`` (least significant bit
first) of word ``t // 32`` is set. Tokens past the mask's ``32 * words`` (a model vocabulary
padded beyond the tokenizer's) are disallowed; mask bits past the logits' width are ignored.

``row_indices`` (optional, int ``[rows]``) says which logits row each bitmask row applies to;
without it bitmask row ``i`` applies to logits row ``i``. On CUDA tensors a Triton kernel does the
work; elsewhere (or without triton) plain torch does.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None

BLOCK_TOKENS = 4096


def _apply_bitmask(
    logits_ptr,  # [num_logit_rows, vocab_size], last dim contiguous
    bitmask_ptr,  # [num_rows, num_words] int32, last dim contiguous
    row_indices_ptr,  # [num_rows] int (read only when HAS_ROWS)
    vocab_size,
    num_words,
    stride_logits_row,
    stride_mask_row,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if HAS_ROWS:
        logit_row = tl.load(row_indices_ptr + row).to(tl.int64)
    else:
        logit_row = row.to(tl.int64)
    in_vocab = offs < vocab_size
    word_idx = offs // 32
    words = tl.load(bitmask_ptr + row * stride_mask_row + word_idx,
                    mask=in_vocab & (word_idx < num_words), other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + logit_row * stride_logits_row + offs, neg_inf, mask=in_vocab & ~allowed)


@functools.cache
def _bitmask_kernel():
    """JIT-wraps the kernel on first use, so ``TRITON_INTERPRET`` is read then and not when
    this module is first imported (samplers import it early)."""
    return triton.jit(_apply_bitmask)


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None = None
) -> None:
    """Sets ``logits[row, t] = -inf`` for every token ``t`` the bitmask disallows."""
    _validate(logits, bitmask, row_indices)
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if row_indices is not None and row_indices.device != logits.device:
        row_indices = row_indices.to(logits.device, non_blocking=True)
    if logits.is_cuda and triton is not None:
        apply_token_bitmask_inplace_triton(logits, bitmask, row_indices)
    else:
        apply_token_bitmask_inplace_torch(logits, bitmask, row_indices)


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None = None
) -> None:
    """The Triton path (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    assert triton is not None, "triton is not installed"
    assert logits.stride(-1) == 1, "logits need a contiguous last dimension"
    bitmask = bitmask.contiguous()
    num_rows, num_words = bitmask.shape
    if num_rows == 0:
        return
    vocab_size = logits.shape[-1]
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK_TOKENS))
    rows = row_indices if row_indices is not None else bitmask  # unused pointer when absent
    _bitmask_kernel()[grid](
        logits, bitmask, rows, vocab_size, num_words, logits.stride(0), bitmask.stride(0),
        HAS_ROWS=row_indices is not None, BLOCK=BLOCK_TOKENS,
    )


def apply_token_bitmask_inplace_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None = None
) -> None:
    """The reference path on plain torch (any device)."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    if row_indices is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = row_indices.to(torch.int64)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[rows, words]`` -> bool ``[rows, vocab_size]`` (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).bool()
    bits = bits.flatten(-2)
    if bits.shape[-1] >= vocab_size:
        return bits[..., :vocab_size]
    pad = torch.zeros((*bits.shape[:-1], vocab_size - bits.shape[-1]), dtype=torch.bool,
                      device=bits.device)
    return torch.cat([bits, pad], dim=-1)


def _validate(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None
) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits and bitmask must be 2-D, got {tuple(logits.shape)} and "
                         f"{tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    expected = logits.shape[0] if row_indices is None else row_indices.shape[0]
    if bitmask.shape[0] != expected:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, expected {expected}")
