"""How KV bytes move between the device KV buffers and a :class:`HostKVPool`.

The device side is the runtime's per-layer buffers ``k_buffers[l]`` / ``v_buffers[l]``, each
``[num_slots, num_kv_heads, head_dim]``, indexed by any int64 slot tensor (on the CPU or the
buffers' device) whose length is a multiple of ``page_size``; the host side is whole host
pages (:meth:`HostKVPool.page_ids`). Device slot ``device_slots[i]`` pairs with host slot
``host_slots[i]``. A copy goes through a staging tensor on the device laid out like host pages
(``[pages, num_layers, 2, page_size, num_kv_heads, head_dim]``), so each run of consecutive
host pages crosses the bus in one transfer, and a layer-major copy of it
(``[num_layers, 2, tokens, num_kv_heads, head_dim]``) that one ``index_select`` /
``index_copy_`` per layer and K/V gathers from or scatters into. Large copies are cut into
chunks of pages so that each of the two stays under ``max_staging_bytes``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from radixlm.hicache.host_pool import HostKVPool

DEFAULT_MAX_STAGING_BYTES = 64 * 2**20


class CopyOp:
    """Handle of one issued copy; this base class is a copy that finished when it was issued.

    ``num_bytes`` is the KV payload moved (tokens x ``bytes_per_token``). ``seconds`` is its
    measured duration once done, None before. ``layer_events`` is, for a CUDA load, one event
    per layer recorded once that layer's K and V are in place in the device buffers (empty
    otherwise). ``wait_layer`` / ``make_stream_wait`` make a CUDA stream (None: the current
    stream) wait for one layer / the whole copy without blocking the CPU; they do nothing for
    a finished copy.
    """

    def __init__(self, num_bytes: int, seconds: float | None = 0.0):
        self.num_bytes = num_bytes
        self._seconds = seconds
        self.layer_events: list[torch.cuda.Event] = []

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        """Blocks the CPU until the copy has finished."""

    @property
    def seconds(self) -> float | None:
        return self._seconds if self.done() else None

    def wait_layer(self, stream: torch.cuda.Stream | None, layer: int) -> None:
        pass

    def make_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_bytes={self.num_bytes}, done={self.done()})"


class CudaCopyOp(CopyOp):
    """A copy queued on a side stream. ``done()`` asks, without blocking, whether the side
    stream has run past the copy's last operation; the first time it has, ``seconds`` is read
    from the CUDA timing events around the copy (the time the copy itself ran, not the time it
    waited for the streams it was ordered after)."""

    def __init__(
        self,
        num_bytes: int,
        device: torch.device,
        start: torch.cuda.Event,
        end: torch.cuda.Event,
        layer_events: list[torch.cuda.Event],
        keep_alive: tuple[torch.Tensor, ...],
    ):
        super().__init__(num_bytes, seconds=None)
        self.device = device
        self.layer_events = layer_events
        self._start = start
        self._end = end
        self._keep_alive = keep_alive  # tensors the queued copy still reads

    def done(self) -> bool:
        if self._seconds is None and self._end.query():
            self._finish()
        return self._seconds is not None

    def wait(self) -> None:
        if self._seconds is None:
            self._end.synchronize()
            self._finish()

    def _finish(self) -> None:
        self._seconds = self._start.elapsed_time(self._end) / 1e3
        self._keep_alive = ()

    def wait_layer(self, stream: torch.cuda.Stream | None, layer: int) -> None:
        event = self.layer_events[layer] if self.layer_events else self._end
        (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def make_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        (stream or torch.cuda.current_stream(self.device)).wait_event(self._end)


class CopyEngine:
    """Moves whole pages of KV between device buffers and a host pool.

    Contract (every engine):

    - ``write`` (device -> host) reads the device slots as of the moment it is called: on
      CUDA, after all work already queued on the current (compute) stream, so KV that the
      forward pass just wrote is included. Until the op is done the device slots must not be
      overwritten (free them only after ``done()``, or make the compute stream wait with
      ``op.make_stream_wait()`` before reusing them) and the host pages must not be read
      (``HostKVPool.page_bytes``) or freed.
    - ``load`` (host -> device) overwrites the device slots after all work already queued on
      the current stream (which may still read what those slots held before). Until the op is
      done the host pages must not be freed; the device slots may be read only after
      ``op.make_stream_wait(stream)`` (or ``op.wait_layer(stream, layer)`` per layer).
    - ``after``: ops this copy must follow (a load of host pages that a pending write fills; a
      write into host pages that a pending load still reads). The controller passes these.
    - Copies of the same direction run in issue order; writes and loads are not ordered with
      each other except through ``after``.

    Subclasses implement ``_write`` / ``_load`` on validated, non-empty copies: ``pages`` are
    host page ids ([n] int64 CPU), ``index`` the device slots ([n, page_size] int64, on the
    CPU or the buffers' device).
    """

    def write(
        self,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        device_slots: torch.Tensor,
        host_pool: HostKVPool,
        host_slots: torch.Tensor,
        after: Sequence[CopyOp] = (),
    ) -> CopyOp:
        pages, index = _plan(k_buffers, v_buffers, device_slots, host_pool, host_slots)
        if pages.numel() == 0:
            return CopyOp(0)
        return self._write(k_buffers, v_buffers, index, host_pool, pages, after)

    def load(
        self,
        host_pool: HostKVPool,
        host_slots: torch.Tensor,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        device_slots: torch.Tensor,
        after: Sequence[CopyOp] = (),
    ) -> CopyOp:
        pages, index = _plan(k_buffers, v_buffers, device_slots, host_pool, host_slots)
        if pages.numel() == 0:
            return CopyOp(0)
        return self._load(host_pool, pages, k_buffers, v_buffers, index, after)

    def _write(
        self,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        index: torch.Tensor,
        host_pool: HostKVPool,
        pages: torch.Tensor,
        after: Sequence[CopyOp],
    ) -> CopyOp:
        raise NotImplementedError

    def _load(
        self,
        host_pool: HostKVPool,
        pages: torch.Tensor,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        index: torch.Tensor,
        after: Sequence[CopyOp],
    ) -> CopyOp:
        raise NotImplementedError


class SyncCopyEngine(CopyEngine):
    """Copies on the calling thread (and, on CUDA, the current stream, then synchronizes it):
    the op is done on return and ``seconds`` is wall-clock time (perf_counter)."""

    def _write(self, k_buffers, v_buffers, index, host_pool, pages, after) -> CopyOp:
        device = k_buffers[0].device
        t0 = self._start(device, after)
        staged, by_layer = _staging_tensors(pages.numel(), host_pool, device)
        _gather_pages(k_buffers, v_buffers, index.to(device), by_layer, staged)
        host_pool.data.index_copy_(0, pages, staged.cpu())
        return CopyOp(pages.numel() * host_pool.bytes_per_page, time.perf_counter() - t0)

    def _load(self, host_pool, pages, k_buffers, v_buffers, index, after) -> CopyOp:
        device = k_buffers[0].device
        t0 = self._start(device, after)
        _, by_layer = _staging_tensors(pages.numel(), host_pool, device)
        _pages_to_layers(host_pool.data.index_select(0, pages).to(device), by_layer)
        _scatter_layers(by_layer, k_buffers, v_buffers, index.to(device))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return CopyOp(pages.numel() * host_pool.bytes_per_page, time.perf_counter() - t0)

    @staticmethod
    def _start(device: torch.device, after: Sequence[CopyOp]) -> float:
        for op in after:
            op.wait()
        if device.type == "cuda":  # time the copy, not the queued compute work before it
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()


class CudaCopyEngine(CopyEngine):
    """Asynchronous copies on two dedicated streams of ``device``: ``write_stream`` for device
    -> host, ``load_stream`` for host -> device. Each copy first makes its stream wait for the
    current stream (and for the ``after`` ops), then gathers / scatters on its stream and moves
    the bytes with non-blocking transfers from / into the pinned host pool, so the CPU never
    waits. A load records ``layer_events[l]`` once layer ``l``'s K and V are in place: the
    transfer is page-major (a page holds all layers), so every byte of the copy has crossed
    the bus before the first event, which then fire one after another as each layer is
    scattered from the staging tensor (in a copy cut into chunks, after the last chunk's).

    Each direction keeps its two staging buffers (up to ``max_staging_bytes`` each) between
    copies, so steady-state copies allocate no device memory (a first allocation can
    synchronize the device). Device slots given as a CPU tensor are pinned (torch's caching
    host allocator, as in ``tensor_to_device``) and sent ahead on the side stream; a pinned
    block of a new size can also synchronize, so hot paths pass CUDA slot tensors.
    """

    def __init__(
        self, device: torch.device | str, max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES
    ):
        if not torch.cuda.is_available():
            raise ValueError("CudaCopyEngine needs a CUDA device; use SyncCopyEngine")
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.max_staging_bytes = max_staging_bytes
        self.write_stream = torch.cuda.Stream(device)
        self.load_stream = torch.cuda.Stream(device)
        # per stream: (host-layout pages, layer-major) flat uint8 buffers on `device`
        self._staging_buffers: dict[torch.cuda.Stream, tuple[torch.Tensor, ...]] = {}

    def _write(self, k_buffers, v_buffers, index, host_pool, pages, after) -> CopyOp:
        stream, start, end = self._begin(self.write_stream, k_buffers, host_pool, after)
        with torch.cuda.stream(stream):
            start.record(stream)
            index = self._to_device(index, stream)
            for lo, hi in self._chunks(pages.numel(), host_pool):
                staged, by_layer = self._staging(stream, hi - lo, host_pool)
                _gather_pages(k_buffers, v_buffers, index[lo:hi], by_layer, staged)
                for page, offset, count in host_pool.page_runs(pages[lo:hi]):
                    host_pool.data[page : page + count].copy_(
                        staged[offset : offset + count], non_blocking=True
                    )
            end.record(stream)
        num_bytes = pages.numel() * host_pool.bytes_per_page
        return CudaCopyOp(num_bytes, self.device, start, end, [], (index,))

    def _load(self, host_pool, pages, k_buffers, v_buffers, index, after) -> CopyOp:
        stream, start, end = self._begin(self.load_stream, k_buffers, host_pool, after)
        layer_events = [torch.cuda.Event() for _ in k_buffers]
        chunks = self._chunks(pages.numel(), host_pool)
        with torch.cuda.stream(stream):
            start.record(stream)
            index = self._to_device(index, stream)
            for i, (lo, hi) in enumerate(chunks):
                staged, by_layer = self._staging(stream, hi - lo, host_pool)
                for page, offset, count in host_pool.page_runs(pages[lo:hi]):
                    staged[offset : offset + count].copy_(
                        host_pool.data[page : page + count], non_blocking=True
                    )
                _pages_to_layers(staged, by_layer)
                last = i == len(chunks) - 1
                events = layer_events if last else ()
                _scatter_layers(by_layer, k_buffers, v_buffers, index[lo:hi], events)
            end.record(stream)
        num_bytes = pages.numel() * host_pool.bytes_per_page
        return CudaCopyOp(num_bytes, self.device, start, end, layer_events, (index,))

    def _begin(
        self,
        stream: torch.cuda.Stream,
        k_buffers: Sequence[torch.Tensor],
        host_pool: HostKVPool,
        after: Sequence[CopyOp],
    ) -> tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]:
        if k_buffers[0].device != self.device:
            raise ValueError(f"KV buffers on {k_buffers[0].device}, copy engine on {self.device}")
        if not host_pool.is_pinned:
            raise ValueError("CudaCopyEngine needs a pinned host pool (pin_memory=True)")
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for op in after:
            op.make_stream_wait(stream)
        return stream, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _to_device(self, index: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
        """``index`` on the device, usable on ``stream`` (called inside ``stream``'s context)."""
        if index.device.type == "cuda":
            index.record_stream(stream)  # the caller's tensor: not reused before we are done
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _staging(
        self, stream: torch.cuda.Stream, num_pages: int, host_pool: HostKVPool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``stream``'s staging buffers for ``num_pages`` pages (as
        :func:`_staging_tensors`), called inside ``stream``'s context: a buffer that grows is
        freed to that stream and only reused in its order."""
        num_bytes = num_pages * host_pool.bytes_per_page
        buffers = self._staging_buffers.get(stream)
        if buffers is None or buffers[0].numel() < num_bytes:
            new = (torch.empty(num_bytes, dtype=torch.uint8, device=self.device) for _ in "pl")
            buffers = self._staging_buffers[stream] = tuple(new)
        staged, by_layer = (b[:num_bytes].view(host_pool.dtype) for b in buffers)
        shape = (num_pages, *host_pool.data.shape[1:])
        return staged.view(shape), by_layer.view(_layer_major_shape(num_pages, host_pool))

    def _chunks(self, num_pages: int, host_pool: HostKVPool) -> list[tuple[int, int]]:
        per_chunk = max(1, self.max_staging_bytes // host_pool.bytes_per_page)
        return [(lo, min(lo + per_chunk, num_pages)) for lo in range(0, num_pages, per_chunk)]


def make_copy_engine(device: torch.device | str, host_pool: HostKVPool) -> CopyEngine:
    """The asynchronous CUDA engine where it can run (a CUDA device and a pinned pool), else
    the synchronous one."""
    device = torch.device(device)
    if device.type == "cuda" and host_pool.is_pinned:
        return CudaCopyEngine(device)
    return SyncCopyEngine()


# ---------------------------------------------------------------------------------- helpers


def _plan(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    device_slots: torch.Tensor,
    host_pool: HostKVPool,
    host_slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates a copy; returns (host page ids [n] int64 CPU, device slots [n, page_size]
    int64 on device_slots' device)."""
    host_pool.check_buffers(k_buffers, v_buffers)
    pages = host_pool.page_ids(host_slots)
    if device_slots.numel() != pages.numel() * host_pool.page_size:
        raise ValueError(
            f"{device_slots.numel()} device slots for {pages.numel() * host_pool.page_size} "
            f"host slots"
        )
    return pages, device_slots.reshape(-1, host_pool.page_size).to(torch.int64)


def _layer_major_shape(num_pages: int, host_pool: HostKVPool) -> tuple[int, ...]:
    num_tokens = num_pages * host_pool.page_size
    return (host_pool.num_layers, 2, num_tokens, host_pool.num_kv_heads, host_pool.head_dim)


def _staging_tensors(
    num_pages: int, host_pool: HostKVPool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh staging for ``num_pages`` pages on ``device``: host-layout pages
    [pages, num_layers, 2, page_size, num_kv_heads, head_dim] and the same KV layer-major,
    [num_layers, 2, pages * page_size, num_kv_heads, head_dim]."""
    staged = torch.empty(
        (num_pages, *host_pool.data.shape[1:]), dtype=host_pool.dtype, device=device
    )
    by_layer = torch.empty(
        _layer_major_shape(num_pages, host_pool), dtype=host_pool.dtype, device=device
    )
    return staged, by_layer


def _gather_pages(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    index: torch.Tensor,
    by_layer: torch.Tensor,
    staged: torch.Tensor,
) -> None:
    """Gathers the KV at ``index`` ([pages, page_size] int64, on the buffers' device) into
    ``by_layer`` (one ``index_select`` per layer and K/V), then transposes it into host-layout
    pages ``staged`` (see :func:`_staging_tensors`)."""
    flat = index.reshape(-1)
    num_layers, _, num_tokens, *head = by_layer.shape
    outs = by_layer.view(num_layers * 2, num_tokens, *head).unbind(0)
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        torch.index_select(k, 0, flat, out=outs[2 * layer])
        torch.index_select(v, 0, flat, out=outs[2 * layer + 1])
    pages = by_layer.view(num_layers, 2, index.shape[0], index.shape[1], *head)
    staged.copy_(pages.permute(2, 0, 1, 3, 4, 5))


def _pages_to_layers(staged: torch.Tensor, by_layer: torch.Tensor) -> None:
    """Transposes host-layout pages ``staged`` into layer-major ``by_layer``."""
    num_pages, num_layers, _, page_size, *head = staged.shape
    by_layer.view(num_layers, 2, num_pages, page_size, *head).copy_(
        staged.permute(1, 2, 0, 3, 4, 5)
    )


def _scatter_layers(
    by_layer: torch.Tensor,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    index: torch.Tensor,
    layer_events: Sequence[torch.cuda.Event] = (),
) -> None:
    """Writes layer-major KV ``by_layer`` into the buffers at ``index`` ([pages, page_size]
    int64), one ``index_copy_`` per layer and K/V; records ``layer_events[l]`` on the current
    stream once layer ``l`` is written, when given."""
    flat = index.reshape(-1)
    num_layers, _, num_tokens, *head = by_layer.shape
    sources = by_layer.view(num_layers * 2, num_tokens, *head).unbind(0)
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        k.index_copy_(0, flat, sources[2 * layer])
        v.index_copy_(0, flat, sources[2 * layer + 1])
        if layer_events:
            layer_events[layer].record()
