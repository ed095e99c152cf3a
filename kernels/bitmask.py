"""Applies a packed vocabulary bitmask to logits in place: disallowed tokens become ``-inf``.

Layout (shared by outlines-core, llguidance and XGrammar): ``bitmask`` is int32
``[B, ceil(V / 32)]`` and token ``t`` is allowed when bit ``t % 32`` (least significant bit
first) of word ``t // 32`` is set. Tokens past the mask's ``32 * words`` (a model vocabulary
padded beyond the tokenizer's) are disallowed; mask bits past the logits' width are ignored.

``rows`` (optional int indices) restricts the masking to those batch rows, row ``r`` of the
logits using row ``r`` of the bitmask; other rows stay untouched (the same contract as
``radixlm.grammar.bitmask``). On CUDA tensors a Triton kernel does the work; on the CPU a byte
lookup table does (``apply_token_bitmask_inplace_lut``: each mask byte picks 8 bounds, +inf or
-inf, and ``logits = min(logits, bounds)``: about 5x faster than unpacking bits with shifts and
``masked_fill_`` for 16 rows of a 49k vocabulary on 2 cores); elsewhere plain torch does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None

BLOCK_TOKENS = 4096
_BYTE_BOUNDS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _apply_bitmask(
    logits_ptr,  # [B, vocab_size], last dim contiguous
    bitmask_ptr,  # [B, num_words] int32, last dim contiguous
    rows_ptr,  # [grid rows] int64: the batch rows to mask (read only when HAS_ROWS)
    vocab_size,
    num_words,
    stride_logits_row,
    stride_mask_row,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if HAS_ROWS:
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    in_vocab = offs < vocab_size
    word_idx = offs // 32
    words = tl.load(
        bitmask_ptr + row * stride_mask_row + word_idx,
        mask=in_vocab & (word_idx < num_words),
        other=0,
    )
    allowed = ((words >> (offs % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits_row + offs, neg_inf, mask=in_vocab & ~allowed)


@functools.cache
def _bitmask_kernel():
    """JIT-wraps the kernel on first use, so ``TRITON_INTERPRET`` is read then and not when
    this module is first imported (samplers import it early)."""
    return triton.jit(_apply_bitmask)


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: Sequence[int] | torch.Tensor | None = None,
) -> None:
    """Sets ``logits[r, t] = -inf`` for every token ``t`` that ``bitmask[r]`` disallows, for
    every batch row ``r`` (or only the rows in ``rows``)."""
    _validate(logits, bitmask)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    index = None
    if rows is not None:
        index = torch.as_tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        if index.numel() == 0:
            return
    if logits.is_cuda and triton is not None:
        apply_token_bitmask_inplace_triton(logits, bitmask, index)
    elif logits.is_cpu:
        apply_token_bitmask_inplace_lut(logits, bitmask, index)
    else:
        apply_token_bitmask_inplace_torch(logits, bitmask, index)


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """The Triton path (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``);
    ``rows`` is an int64 tensor on the logits' device."""
    assert triton is not None, "triton is not installed"
    assert logits.stride(-1) == 1, "logits need a contiguous last dimension"
    bitmask = bitmask.contiguous()
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    if num_rows == 0:
        return
    vocab_size = logits.shape[-1]
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK_TOKENS))
    _bitmask_kernel()[grid](
        logits,
        bitmask,
        bitmask if rows is None else rows,  # the rows pointer is unused if None
        vocab_size,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        HAS_ROWS=rows is not None,
        BLOCK=BLOCK_TOKENS,
    )


def apply_token_bitmask_inplace_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """The reference path on plain torch (any device)."""
    if rows is None:
        logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))
        return
    allowed = unpack_bitmask(bitmask.index_select(0, rows), logits.shape[-1])
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


def apply_token_bitmask_inplace_lut(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """The CPU path: a ``[256, 8]`` table turns each mask byte into 8 upper bounds (+inf where
    the bit is set, -inf where not) and ``logits`` becomes ``min(logits, bounds)``: one gather
    and one pass over the logits. Same result as the reference, except that a disallowed NaN
    logit stays NaN. ``rows`` is an int64 tensor on the logits' device."""
    vocab_size = logits.shape[-1]
    covered = min(vocab_size, bitmask.shape[-1] * 32) // 8 * 8  # tokens the table handles
    mask = bitmask if rows is None else bitmask.index_select(0, rows)
    target = logits if rows is None else logits.index_select(0, rows)
    if covered:
        codes = mask.contiguous().view(torch.uint8)[:, : covered // 8].flatten().int()
        bounds = _byte_bounds(logits.dtype, logits.device).index_select(0, codes)
        head = target[:, :covered]
        torch.minimum(head, bounds.view(head.shape), out=head)
    if covered < vocab_size:  # a partial byte, or tokens past the mask
        apply_token_bitmask_inplace_torch(target[:, covered:], _shift_bits(mask, covered))
    if rows is not None:
        logits.index_copy_(0, rows, target)


def _byte_bounds(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 8]``: entry ``[b, i]`` is +inf when bit ``i`` of byte ``b`` is set, else -inf."""
    bounds = _BYTE_BOUNDS.get((dtype, device))
    if bounds is None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        bounds = torch.where(bits.bool(), float("inf"), float("-inf")).to(device, dtype)
        _BYTE_BOUNDS[(dtype, device)] = bounds
    return bounds


def _shift_bits(bitmask: torch.Tensor, start: int) -> torch.Tensor:
    """The words of ``bitmask`` from token ``start`` (a multiple of 8) on, re-aligned so that
    token ``start`` is bit 0 of word 0."""
    data = bitmask.contiguous().view(torch.uint8)[:, start // 8 :]
    pad = (-data.shape[1]) % 4
    if pad:
        data = torch.cat([data, data.new_zeros((data.shape[0], pad))], dim=1)
    return data.contiguous().view(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[rows, words]`` -> bool ``[rows, vocab_size]`` (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).bool()
    bits = bits.flatten(-2)
    if bits.shape[-1] >= vocab_size:
        return bits[..., :vocab_size]
    pad = torch.zeros(
        (*bits.shape[:-1], vocab_size - bits.shape[-1]), dtype=torch.bool, device=bits.device
    )
    return torch.cat([bits, pad], dim=-1)


def _validate(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(
            f"logits and bitmask must be 2-D, got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}")
