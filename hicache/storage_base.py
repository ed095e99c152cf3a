"""The contract every HiCache storage tier implements.

A page store maps a page key (16 bytes, see ``page_hash``) to one page's payload: the KV bytes
of ``page_size`` tokens, all layers, as one contiguous buffer. Alongside the payload a store
keeps the page's token ids, and answers a ``get`` only when they match the caller's.

Contract
--------
* Thread-safety. Every method may be called from any thread, concurrently with any other.
* Verified reads. ``get`` never returns a payload whose token ids or checksum do not match:
  any mismatch, truncation or read error is a miss (``None``), and the bad entry is deleted.
  ``exists(key)`` true followed by ``get(key)`` returning ``None`` is therefore normal (the
  entry was evicted, deleted, or found corrupt in between); callers treat it as a miss.
* Atomic writes. A ``set`` that fails (I/O error, full disk, page too big) returns ``False``
  and leaves no partial entry visible; the store stays usable. ``set`` of a key already stored
  (or being stored by another thread) does not rewrite it and returns ``True``.
* Bounded size. ``used_bytes() <= max_bytes`` whenever no call is in progress; a store makes
  room by evicting its least-recently-used entries (a hit or a set refreshes an entry).
* Failure is a miss. A store never raises because of its medium on ``get``/``set``; it counts
  the error in ``stats()``. Malformed arguments (a key that is not 16 bytes) raise
  ``ValueError``.
* Zero-copy pages. ``set`` may be given a :class:`PageView` (the payload as views of memory its
  owner may reuse, e.g. the host KV pool's page blocks) instead of bytes: the store reads the
  blocks in order and stores the page only if ``is_current()`` still holds once it has read
  them (checked before the entry becomes visible); else it returns False. ``get_into`` reads a
  verified payload straight into caller-given blocks (False on a miss: the blocks' contents
  are then undefined).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixlm.hicache.page_hash import KEY_BYTES


@dataclass(frozen=True)
class PageView:
    """A page's payload as ``blocks`` (byte views, in order) of memory that its owner may reuse
    once ``is_current()`` turns False (then the bytes read may be another page's)."""

    blocks: tuple[memoryview, ...]
    is_current: Callable[[], bool]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def to_bytes(self) -> bytes | None:
        """A copy of the payload, or None if the page went stale while it was copied."""
        data = b"".join(self.blocks)
        return data if self.is_current() else None


Payload = bytes | memoryview


def fill_blocks(blocks: Sequence[memoryview], payload: Payload | Sequence[Payload]) -> bool:
    """Copies ``payload`` (bytes, or a sequence of byte blocks read in order) into ``blocks`` in
    order, block boundaries free to differ; False (nothing copied) on a size mismatch."""
    parts = [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload
    sources = [memoryview(p).cast("B") for p in parts]
    if sum(s.nbytes for s in sources) != sum(b.nbytes for b in blocks):
        return False
    src_iter = iter(sources)
    src = memoryview(b"")
    for block in blocks:
        filled = 0
        while filled < block.nbytes:
            if not src.nbytes:
                src = next(src_iter)
                continue
            n = min(src.nbytes, block.nbytes - filled)
            block[filled : filled + n] = src[:n]
            src, filled = src[n:], filled + n
    return True


def check_key(key: bytes) -> None:
    """Raise ValueError unless ``key`` is a page key."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a page key is {KEY_BYTES} bytes, got {key!r}")


class PageStore(ABC):
    """Pages by key; see the module docstring for the contract."""

    @abstractmethod
    def exists(self, key: bytes) -> bool:
        """Whether ``key`` is stored (an in-memory index lookup: cheap, no I/O)."""

    @abstractmethod
    def get(self, key: bytes, token_ids: Sequence[int]) -> bytes | None:
        """The verified payload of ``key`` stored for exactly ``token_ids``, or None."""

    @abstractmethod
    def set(self, key: bytes, token_ids: Sequence[int], payload: Payload | PageView) -> bool:
        """Store ``payload`` for ``key``/``token_ids``; False when it was not stored."""

    def get_into(self, key: bytes, token_ids: Sequence[int], blocks: Sequence[memoryview]) -> bool:
        """Reads the verified payload of ``key`` into ``blocks`` (in order); False on a miss.
        This default copies from ``get``; a store with a medium reads in place."""
        payload = self.get(key, token_ids)
        return payload is not None and fill_blocks(blocks, payload)

    @abstractmethod
    def delete(self, key: bytes) -> None:
        """Drop ``key`` if stored."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every entry."""

    @abstractmethod
    def num_pages(self) -> int:
        """Number of stored entries."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes the stored entries take on the medium."""

    def stats(self) -> dict[str, int | float]:
        """Counters for metrics; at least ``pages`` and ``used_bytes``."""
        return {"pages": self.num_pages(), "used_bytes": self.used_bytes()}

    def check_integrity(self) -> None:  # noqa: B027  (optional: a store without a medium)
        """Assert the store's invariants (its index agrees with its medium)."""

    def close(self) -> None:  # noqa: B027  (optional: most stores hold nothing to release)
        """Release resources; later calls miss and store nothing."""


class NullPageStore(PageStore):
    """Stores nothing: every ``get`` is a miss and every ``set`` returns False."""

    def exists(self, key: bytes) -> bool:
        return False

    def get(self, key: bytes, token_ids: Sequence[int]) -> bytes | None:
        return None

    def set(self, key: bytes, token_ids: Sequence[int], payload: Payload | PageView) -> bool:
        return False

    def delete(self, key: bytes) -> None:
        pass

    def clear(self) -> None:
        pass

    def num_pages(self) -> int:
        return 0

    def used_bytes(self) -> int:
        return 0
