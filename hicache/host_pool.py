"""The host tier's KV pool: whole pages of K and V for every layer, in CPU memory.

The pool is laid out layer-major, ``[num_layers, num_pages, 2 (K, V), page_size, num_kv_heads,
head_dim]``: one layer's K and V of a run of consecutive pages are one contiguous block, so a
device <-> host copy moves layer by layer (a load hands layer ``l`` to the forward before layer
``l + 1`` has crossed the bus), one transfer per layer and run of pages. A page's payload (what
the disk tier stores, :meth:`page_bytes`) is ``[num_layers, 2, page_size, num_kv_heads,
head_dim]``: the page's ``num_layers`` blocks (:meth:`page_blocks`) in order. Host slot ``s`` is
token ``s % page_size`` of page ``s // page_size``; slots start at 0 (there is no padding slot). Every slot tensor handed out or taken back covers whole pages, each page's
slots in order (``alloc`` returns them so, and concatenations of such tensors stay so).
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Sequence

import psutil
import torch

from radixlm.hicache.storage_base import PageView


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class HostKVPool:
    """Host memory for ``num_tokens`` tokens (rounded down to whole pages) of KV.

    ``pin_memory=True`` page-locks the buffer (registered with CUDA in place, so the pool takes
    exactly its size) so that asynchronous copies can read and write it; it needs CUDA. The
    buffer is allocated at construction; a size beyond the RAM available is refused.
    """

    def __init__(
        self,
        num_tokens: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_tokens < page_size:
            raise ValueError(
                f"host KV pool num_tokens={num_tokens} is less than one page "
                f"(page_size={page_size}); give the host tier at least {page_size} tokens"
            )
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * _element_size(dtype)
        self.bytes_per_page = self.bytes_per_token * page_size
        _check_ram(self.num_pages * self.bytes_per_page, self.num_pages * page_size)
        # [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim] `dtype` on the CPU,
        # page-locked when pin_memory
        self.data = torch.empty(
            (num_layers, self.num_pages, 2, page_size, num_kv_heads, head_dim), dtype=dtype
        )
        if pin_memory:
            self.data.zero_()  # touches the pages with torch's threads: locking them is faster
            _pin_in_place(self, self.data)
        # the same memory as one flat byte view: a page's blocks are slices of it (no torch or
        # numpy call per block: a page's list of views is built on every disk read and write)
        self._bytes = memoryview(self.data.view(-1).view(torch.uint8).numpy()).cast("B")
        self._block_bytes = self.bytes_per_page // num_layers  # one layer's K and V of a page
        self._free_pages: list[int] = list(range(self.num_pages))  # a min-heap of free page ids
        # [num_pages] bool on the CPU: True where the page is free
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)
        # per page: bumped when the page is freed, so a reader on another thread can tell that
        # the page it copied may hold another page's KV by now (a list: the disk writer reads
        # it for every page it writes, a tensor read costs ~100x more and holds the GIL)
        self._generation: list[int] = [0] * self.num_pages

    @staticmethod
    def tokens_for_bytes(
        num_bytes: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """The ``num_tokens`` (whole pages) of the largest pool that fits in ``num_bytes``."""
        bytes_per_page = 2 * num_layers * num_kv_heads * head_dim * _element_size(dtype) * page_size
        return num_bytes // bytes_per_page * page_size

    @property
    def is_pinned(self) -> bool:
        return self.data.is_pinned()

    # ------------------------------------------------------------------------------ accounting

    def total_size(self) -> int:
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def used_size(self) -> int:
        return self.total_size() - self.available_size()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots of ``num_tokens // page_size`` fresh pages (int64, CPU), lowest free ids first
        so that copies find long runs of consecutive pages; None (nothing taken) when there are
        not that many free pages."""
        if num_tokens % self.page_size or num_tokens < 0:
            raise ValueError(f"alloc({num_tokens}): not a multiple of page_size={self.page_size}")
        num_pages = num_tokens // self.page_size
        if num_pages > len(self._free_pages):
            return None
        pages = torch.tensor(
            [heapq.heappop(self._free_pages) for _ in range(num_pages)], dtype=torch.int64
        )
        self._is_free[pages] = False
        return self._slots_of(pages)

    def free(self, host_slots: torch.Tensor) -> None:
        """Takes back the whole pages that ``host_slots`` cover. Freeing a free page (or a page
        twice in one call) is a bug in the caller and raises AssertionError."""
        pages = self.page_ids(host_slots)
        if pages.numel() == 0:
            return
        if torch.unique(pages).numel() != pages.numel() or bool(self._is_free[pages].any()):
            raise AssertionError(f"host pages freed twice: {pages.tolist()}")
        self._is_free[pages] = True
        for page in pages.tolist():
            self._generation[page] += 1
            heapq.heappush(self._free_pages, page)

    def page_ids(self, host_slots: torch.Tensor) -> torch.Tensor:
        """The page of each ``page_size`` slots (int64, CPU); ValueError unless the slots are
        whole pages of this pool, each page's slots in order."""
        slots = host_slots.to("cpu", torch.int64).reshape(-1)
        if slots.numel() % self.page_size:
            raise ValueError(f"{slots.numel()} host slots are not whole pages of {self.page_size}")
        pages = slots[:: self.page_size] // self.page_size
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= self.num_pages):
            raise ValueError(f"host slots outside the pool's {self.num_pages} pages")
        if not torch.equal(self._slots_of(pages), slots):
            raise ValueError("host slots do not cover whole pages in order")
        return pages

    @staticmethod
    def page_runs(pages: torch.Tensor) -> list[tuple[int, int, int]]:
        """(first page, offset in ``pages``, number of pages) of each run of consecutive page
        ids in ``pages`` ([n] int64 CPU): one contiguous block of ``data[layer]`` each."""
        if pages.numel() == 0:
            return []
        breaks = (torch.nonzero(pages[1:] - pages[:-1] != 1).flatten() + 1).tolist()
        bounds = [0, *breaks, pages.numel()]
        firsts = pages[bounds[:-1]].tolist()
        return [(p, a, b - a) for p, a, b in zip(firsts, bounds, bounds[1:], strict=False)]

    def check_buffers(
        self, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]
    ) -> None:
        """ValueError unless per-layer device KV buffers ``[slots, num_kv_heads, head_dim]``
        hold what a page of this pool holds (layers, heads, head size, dtype)."""
        heads = (self.num_kv_heads, self.head_dim)
        if len(k_buffers) != self.num_layers or len(v_buffers) != self.num_layers:
            raise ValueError(
                f"{len(k_buffers)}/{len(v_buffers)} K/V buffers for a host pool of "
                f"{self.num_layers} layers"
            )
        for buf in (*k_buffers, *v_buffers):
            if tuple(buf.shape[1:]) != heads or buf.dtype != self.dtype:
                raise ValueError(
                    f"KV buffer {tuple(buf.shape)} {buf.dtype} does not match the host pool's "
                    f"[*, {heads[0]}, {heads[1]}] {self.dtype}"
                )

    def _slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    # ------------------------------------------------------------------------------ raw pages

    def page_kv(self, page_id: int) -> torch.Tensor:
        """Page ``page_id`` as ``[num_layers, 2, page_size, num_kv_heads, head_dim]`` (a
        strided view of ``data``)."""
        self._check_page(page_id)
        return self.data[:, page_id]

    def page_blocks(self, page_id: int) -> list[memoryview]:
        """The page's ``num_layers`` contiguous blocks (one layer's K then V each) as writable
        byte views of ``data``: its payload, in order, without a copy (for ``readinto`` /
        ``writev``)."""
        self._check_page(page_id)
        size, flat = self._block_bytes, self._bytes
        layer_stride = self.num_pages * size
        return [flat[o : o + size] for o in range(page_id * size, flat.nbytes, layer_stride)]

    def page_bytes(self, page_id: int) -> bytes:
        """A copy of page ``page_id``'s payload (``bytes_per_page`` bytes)."""
        return b"".join(self.page_blocks(page_id))

    def page_generation(self, page_id: int) -> int:
        """How many times page ``page_id`` was freed so far."""
        return self._generation[page_id]

    def snapshot_page(self, page_id: int, generation: int) -> bytes | None:
        """Page ``page_id``'s bytes if it was not freed since ``generation`` (else None: it
        may hold other KV by now). Safe from another thread: the owner writes a page only
        after allocating it, which follows a free, which bumps the generation first."""
        data = self.page_bytes(page_id)
        return data if self.page_generation(page_id) == generation else None

    def page_view(self, page_id: int, generation: int) -> PageView | None:
        """Page ``page_id``'s payload as views of the pool (no copy) with a check that it was
        not freed since ``generation`` (None if it was already): for a disk writer on another
        thread, which must check ``is_current()`` after reading the views."""
        if self.page_generation(page_id) != generation:
            return None
        blocks = tuple(self.page_blocks(page_id))
        return PageView(blocks, lambda: self.page_generation(page_id) == generation)

    def write_page_bytes(self, page_id: int, payload: bytes | bytearray | memoryview) -> None:
        """Overwrites page ``page_id`` with a payload from :meth:`page_bytes` of a pool of the
        same geometry and dtype; ValueError on a length mismatch."""
        src = memoryview(payload).cast("B")
        if src.nbytes != self.bytes_per_page:
            raise ValueError(
                f"page payload has {src.nbytes} bytes, a page of this pool has {self.bytes_per_page}"
            )
        offset = 0
        for block in self.page_blocks(page_id):
            block[:] = src[offset : offset + block.nbytes]
            offset += block.nbytes

    def _check_page(self, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"page {page_id} outside the pool's {self.num_pages} pages")

    # ------------------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        free = self._free_pages
        assert len(set(free)) == len(free), "a host page is on the free list twice"
        assert int(self._is_free.sum()) == len(free), "free list and free flags disagree"
        if free:
            listed = torch.tensor(free, dtype=torch.int64)
            assert bool(self._is_free[listed].all()), "a used host page is on the free list"
        assert self.available_size() + self.used_size() == self.total_size()

    def __repr__(self) -> str:
        return (
            f"HostKVPool(pages={self.num_pages}, page_size={self.page_size}, "
            f"used_tokens={self.used_size()}, bytes={self.num_pages * self.bytes_per_page}, "
            f"pinned={self.is_pinned})"
        )


def _check_ram(num_bytes: int, num_tokens: int) -> None:
    available = psutil.virtual_memory().available
    if num_bytes > available:
        raise ValueError(
            f"host KV pool of {num_tokens} tokens needs {num_bytes / 2**30:.2f} GiB "
            f"({num_bytes} bytes) but only {available / 2**30:.2f} GiB of RAM is available; "
            f"give the host tier fewer tokens"
        )


def _pin_in_place(owner: object, data: torch.Tensor) -> None:
    """Page-locks ``data``'s memory with cudaHostRegister (no power-of-two rounding, unlike the
    pinned caching allocator) and unregisters it when ``owner`` is collected."""
    if not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA; use pin_memory=False on a CPU-only machine")
    cudart = torch.cuda.cudart()
    num_bytes = data.numel() * data.element_size()
    err = cudart.cudaHostRegister(data.data_ptr(), num_bytes, 0)
    if int(err) != 0:
        raise ValueError(f"could not pin {num_bytes} bytes of host KV pool memory (error {err})")
    weakref.finalize(owner, _unpin, cudart, data)


def _unpin(cudart: object, data: torch.Tensor) -> None:
    try:
        cudart.cudaHostUnregister(data.data_ptr())  # type: ignore[attr-defined]
    except Exception:  # CUDA already torn down at interpreter exit
        pass
