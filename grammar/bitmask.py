"""Packed token bitmasks: allocation, packing, unpacking, the buffer mask fills write into, and
the in-place logits mask.

Layout: int32 ``[batch, ceil(V / 32)]``; token ``t`` is allowed in row ``r`` when bit ``t % 32``
of ``bitmask[r, t // 32]`` is set. Applying a mask to logits is ``radixlm.kernels.bitmask``'s
job (a byte-table CPU path, a Triton kernel on GPUs, a plain-torch reference); it is re-exported
here with the same contract.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from radixlm.kernels.bitmask import apply_token_bitmask_inplace, unpack_bitmask

assert sys.byteorder == "little", "packed bitmask rows assume a little-endian host"

__all__ = [
    "BitmaskBuffer",
    "allocate_token_bitmask",
    "allowed_token_ids",
    "apply_token_bitmask_inplace",
    "bitmask_width",
    "fill_all_allowed",
    "pack_token_ids",
    "unpack_bitmask",
]


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


def allowed_token_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids allowed by ``bitmask[row]`` (for tests, debugging and CPU samplers)."""
    packed = bitmask[row].detach().cpu().contiguous().numpy().view(np.uint8)
    allowed = np.unpackbits(packed, bitorder="little")[:vocab_size]
    return np.flatnonzero(allowed).tolist()


class BitmaskBuffer:
    """A CPU int32 bitmask ``[rows, W]`` with what a mask fill needs to write one row cheaply:
    a flat byte view (``data``), a flat uint32 view (``words``) and the base address.

    Build one per allocated bitmask and keep it. Right after a forward pass the caches are cold,
    and on the 2-core dev CPU two torch ops per row (``bitmask[row].copy_(src)``) then cost
    about 75 us, a byte-slice copy into ``data`` about 13 us. The copy also keeps the GIL, where
    each torch op gives it up and may wait a whole switch interval (5 ms) to get it back from
    another Python thread.
    """

    def __init__(self, bitmask: torch.Tensor) -> None:
        if (
            bitmask.dim() != 2
            or bitmask.dtype != torch.int32
            or not bitmask.is_cpu
            or not bitmask.is_contiguous()
        ):
            raise ValueError("expected a contiguous CPU int32 bitmask [B, ceil(V/32)]")
        self.tensor = bitmask
        self.num_words = bitmask.shape[1]
        self.row_bytes = 4 * self.num_words
        flat = bitmask.numpy().reshape(-1)
        self.data = memoryview(flat.view(np.uint8))  # [B * row_bytes]
        self.words = memoryview(flat.view(np.uint32))  # [B * W]
        self.address = bitmask.data_ptr()

    def write(self, row: int, packed: bytes) -> None:
        """Copies one packed row (``row_bytes`` bytes) into ``row``."""
        start = row * self.row_bytes
        self.data[start : start + self.row_bytes] = packed

    def read(self, row: int) -> bytes:
        """A copy of ``row`` as packed bytes."""
        start = row * self.row_bytes
        return self.data[start : start + self.row_bytes].tobytes()

    def row_address(self, row: int) -> int:
        """The address of ``row``'s first word (for native fills)."""
        return self.address + row * self.row_bytes

    def set_bits(self, row: int, token_ids: Sequence[int]) -> None:
        """Allows ``token_ids`` in ``row`` as well."""
        base = row * self.num_words
        words = self.words
        for token in token_ids:
            words[base + (token >> 5)] |= 1 << (token & 31)
