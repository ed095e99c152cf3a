"""Fault injection for HiCache storage tests: a ``PageStore`` wrapper and page-file damagers.

``FaultyStore(inner, mode="ok", stall_s=0.0)`` forwards to ``inner``; set ``mode`` (any time,
from any thread) to inject a fault:

================  ========================================================================
mode              effect
================  ========================================================================
``ok``            pass through
``fail``          every call (exists, get, set, delete, clear) raises ``OSError(EIO)``
``stall``         get and set sleep ``stall_s`` seconds first (``release()`` wakes them)
``disk_full``     set stores nothing and returns False, as a store does on ENOSPC
``truncate``      get: the stored page file is truncated on disk first
``flip``          get: one payload byte of the stored page file is flipped first
``wrong_tokens``  get: the stored file's token ids are rewritten (old checksum kept) first
================  ========================================================================

The three damaging modes hurt the inner store's own medium, so what is tested is the inner
store's verification (``exists`` true, then ``get`` a miss that deletes the page). An inner
store without ``page_path`` (not on disk) has the page deleted instead, which is what a
verifying store does on finding it bad. ``calls`` counts calls per method, ``faults`` the
faults injected. ``get_into`` (a read straight into the caller's blocks) is forwarded to the
inner store's own and takes the faults of ``get`` (counted as ``get`` calls).

The module-level helpers damage a ``DiskPageStore`` page file directly (``store.page_path``).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from radixlm.hicache.disk_store import TEMP_SUFFIX, DiskPageStore
from radixlm.hicache.page_file import HEADER_SIZE, TOKEN_BYTES
from radixlm.hicache.page_hash import encode_token_ids
from radixlm.hicache.storage_base import PageStore, Payload

MODES = ("ok", "fail", "stall", "disk_full", "truncate", "flip", "wrong_tokens")


# --- damaging page files ----------------------------------------------------------------------


def truncate_file(path: Path, keep_bytes: int | None = None) -> None:
    """Cut the file to ``keep_bytes`` (default: half its size)."""
    size = path.stat().st_size
    os.truncate(path, size // 2 if keep_bytes is None else keep_bytes)


def empty_file(path: Path) -> None:
    """Make the file zero bytes long."""
    os.truncate(path, 0)


def flip_byte(path: Path, offset: int) -> None:
    """Invert every bit of the byte at ``offset`` (negative: from the end)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_payload_byte(path: Path) -> None:
    """Flip the last byte of the file (a payload byte)."""
    flip_byte(path, -1)


def rewrite_token_ids(path: Path, token_ids: Sequence[int]) -> None:
    """Overwrite the file's token ids (same count) and keep its header, old checksum included."""
    data = bytearray(path.read_bytes())
    new = encode_token_ids(token_ids)
    old_count = (len(data) - HEADER_SIZE) // TOKEN_BYTES
    assert len(new) // TOKEN_BYTES <= old_count, "the new token ids must not outgrow the file"
    data[HEADER_SIZE : HEADER_SIZE + len(new)] = new
    path.write_bytes(bytes(data))


def shift_token_ids(path: Path) -> None:
    """Add one to the first token id in the file, keeping the old checksum."""
    data = bytearray(path.read_bytes())
    first = int.from_bytes(data[HEADER_SIZE : HEADER_SIZE + TOKEN_BYTES], "little", signed=True)
    data[HEADER_SIZE : HEADER_SIZE + TOKEN_BYTES] = (first + 1).to_bytes(
        TOKEN_BYTES, "little", signed=True
    )
    path.write_bytes(bytes(data))


def leave_temp_file(store: DiskPageStore, key: bytes, content: bytes = b"half a page") -> Path:
    """A temp file as a write interrupted by a crash leaves it next to the page of ``key``."""
    path = store.page_path(key)
    path.parent.mkdir(exist_ok=True)
    temp = path.with_name(f"{key.hex()}.deadbeef{TEMP_SUFFIX}")
    temp.write_bytes(content)
    return temp


DAMAGE = {"truncate": truncate_file, "flip": flip_payload_byte, "wrong_tokens": shift_token_ids}


# --- the wrapper ------------------------------------------------------------------------------


class FaultyStore(PageStore):
    """A ``PageStore`` that forwards to ``inner`` and injects the fault ``mode`` names."""

    def __init__(self, inner: PageStore, mode: str = "ok", stall_s: float = 0.0) -> None:
        self.inner = inner
        self._released = threading.Event()
        self.mode = mode
        self.stall_s = stall_s
        self.calls: Counter[str] = Counter()
        self.faults = 0

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
        if mode == "stall":
            self._released.clear()
        self._mode = mode

    def release(self) -> None:
        """Wake every stalled call now and go back to mode "ok"."""
        self.mode = "ok"
        self._released.set()

    def _enter(self, method: str) -> None:
        self.calls[method] += 1
        if self.mode == "fail":
            self.faults += 1
            raise OSError(errno.EIO, f"injected I/O error in {method}")
        if self.mode == "stall" and method in ("get", "set"):
            self.faults += 1
            self._released.wait(self.stall_s)

    def exists(self, key: bytes) -> bool:
        self._enter("exists")
        return self.inner.exists(key)

    def get(self, key: bytes, token_ids: Sequence[int]) -> bytes | None:
        self._enter("get")
        return self.inner.get(key, token_ids) if self._damage(key) else None

    def get_into(self, key: bytes, token_ids: Sequence[int], blocks: Sequence[memoryview]) -> bool:
        self._enter("get")  # the inner store's own read into the blocks, faults as for get
        return self._damage(key) and self.inner.get_into(key, token_ids, blocks)

    def _damage(self, key: bytes) -> bool:
        """Damages the stored page as ``mode`` says; False if it was deleted instead."""
        damage = DAMAGE.get(self.mode)
        if damage is not None and self.inner.exists(key):
            self.faults += 1
            page_path = getattr(self.inner, "page_path", None)
            if page_path is None:
                self.inner.delete(key)
                return False
            damage(page_path(key))
        return True

    def set(self, key: bytes, token_ids: Sequence[int], payload: Payload) -> bool:
        self._enter("set")
        if self.mode == "disk_full":
            self.faults += 1
            return False
        return self.inner.set(key, token_ids, payload)

    def delete(self, key: bytes) -> None:
        self._enter("delete")
        self.inner.delete(key)

    def clear(self) -> None:
        self._enter("clear")
        self.inner.clear()

    def num_pages(self) -> int:
        return self.inner.num_pages()

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def stats(self) -> dict[str, int | float]:
        return {**self.inner.stats(), "injected_faults": self.faults}

    def check_integrity(self) -> None:
        self.inner.check_integrity()

    def close(self) -> None:
        self._released.set()
        self.inner.close()
