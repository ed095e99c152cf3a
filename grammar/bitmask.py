"""Packed token bitmasks: allocation, packing, unpacking and the torch in-place logits mask.

Layout: int32 ``[batch, ceil(V / 32)]``; token ``t`` is allowed in row ``r`` when bit ``t % 32``
of ``bitmask[r, t // 32]`` is set. A GPU kernel for the apply step lives in ``kernels/``; this
torch version is the reference and the CPU path.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

assert sys.byteorder == "little", "packed bitmask rows assume a little-endian host"

_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words per row for a vocabulary of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 ``[batch, ceil(vocab_size / 32)]`` bitmask with every token allowed."""
    return torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def fill_all_allowed(bitmask: torch.Tensor, row: int) -> None:
    """Allows every token in ``bitmask[row]`` (rows of unconstrained requests)."""
    bitmask[row].fill_(-1)


def pack_token_ids(token_ids: np.ndarray | Sequence[int], vocab_size: int) -> torch.Tensor:
    """A packed CPU int32 row ``[ceil(vocab_size / 32)]`` with the bits of ``token_ids`` set."""
    allowed = np.zeros(bitmask_width(vocab_size) * 32, dtype=np.bool_)
    allowed[np.asarray(token_ids, dtype=np.int64)] = True
    packed = np.packbits(allowed, bitorder="little").view(np.int32)
    return torch.from_numpy(packed.copy())


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        _BIT_SHIFTS[device] = shifts
    return shifts


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[..., vocab_size]``: True where the token is allowed (``[..., W]`` packed input)."""
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1
    allowed = bits.reshape(*bitmask.shape[:-1], bitmask.shape[-1] * 32).bool()
    if allowed.shape[-1] >= vocab_size:
        return allowed[..., :vocab_size]
    pad = torch.zeros(
        *allowed.shape[:-1], vocab_size - allowed.shape[-1], dtype=torch.bool, device=allowed.device
    )
    return torch.cat([allowed, pad], dim=-1)


def allowed_token_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids allowed by ``bitmask[row]`` (for tests, debugging and CPU samplers)."""
    packed = bitmask[row].detach().cpu().contiguous().numpy().view(np.uint8)
    allowed = np.unpackbits(packed, bitorder="little")[:vocab_size]
    return np.flatnonzero(allowed).tolist()


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Sets disallowed logits to -inf, in place.

    ``logits`` is float ``[B, V]``; ``bitmask`` is int32 ``[B, W]`` on any device (tokens past
    ``32 * W`` are disallowed). ``rows`` restricts masking to those batch rows (row ``i`` of
    ``logits`` uses row ``i`` of ``bitmask``); other rows are left untouched.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("expected logits [B, V] and an int32 bitmask [B, ceil(V/32)]")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask batch {bitmask.shape[0]} != logits batch {logits.shape[0]}")
    mask = bitmask.to(logits.device, non_blocking=True)
    if rows is None:
        disallowed = ~unpack_bitmask(mask, logits.shape[1])
        logits.masked_fill_(disallowed, float("-inf"))
        return
    index = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    if index.numel() == 0:
        return
    disallowed = ~unpack_bitmask(mask.index_select(0, index), logits.shape[1])
    selected = logits.index_select(0, index).masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, index, selected)
