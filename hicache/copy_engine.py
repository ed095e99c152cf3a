"""How KV bytes move between the device KV buffers and a :class:`HostKVPool`.

The device side is the runtime's per-layer buffers ``k_buffers[l]`` / ``v_buffers[l]``, each
``[num_slots, num_kv_heads, head_dim]``, indexed by any int64 slot tensor (on the CPU or the
buffers' device) whose length is a multiple of ``page_size``; the host side is whole host
pages (:meth:`HostKVPool.page_ids`). Device slot ``device_slots[i]`` pairs with host slot
``host_slots[i]``. Copies go layer by layer, in layer order: the host pool is layer-major, so a
layer's K and V of a run of consecutive host pages cross the bus in one transfer, through a
device staging tensor laid out as those pages (``[pages, 2, page_size, num_kv_heads,
head_dim]``) that one indexed gather / scatter per K and V fills from or empties into the
buffers. A load thus lands layer 0 first and records an event per layer (``wait_layer``): a
forward waiting per layer overlaps its first layers with the copy of the later ones. Large
copies are cut into chunks of pages so that a layer's staging stays under ``max_staging_bytes``.
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
    stream) wait for one layer / the whole copy without blocking the CPU; off CUDA the
    "stream" is the calling thread, so they wait for the copy (nothing for a finished one).
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
        self.wait()

    def make_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self.wait()

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


class LayerLoads:
    """The loads (host -> device) the next forward pass must wait for, layer by layer.

    The tree issues a load at admission and :meth:`add` s it here instead of making the
    compute stream wait for the whole copy; the forward calls :meth:`wait_layer` just before
    layer ``l`` reads or writes the KV pool (a stream wait on each load's event ``l``: the CPU
    never blocks), so the copy of the later layers runs under the compute of the earlier ones,
    and :meth:`end_forward` once every layer was issued. :meth:`wait_all` (a whole-copy wait)
    is for work that reads the pool without going layer by layer (a CUDA-graph replay) and for
    slots freed before the forward ran. Off CUDA every wait is a wait for the copy (a
    synchronous copy is done already). An empty one is what a pool without a host tier has.
    Scheduler thread only. ``layer_waits`` counts the
    per-layer waits issued (with loads pending), ``whole_waits`` the whole-copy ones.
    """

    def __init__(self) -> None:
        self._ops: list[CopyOp] = []
        self.layer_waits = 0
        self.whole_waits = 0

    def add(self, op: CopyOp) -> None:
        if not op.done():
            self._ops.append(op)

    def pending(self) -> int:
        return len(self._ops)

    def wait_layer(self, layer: int) -> None:
        for op in self._ops:
            op.wait_layer(None, layer)
            self.layer_waits += 1

    def end_forward(self) -> None:
        """The forward issued every layer's wait: the compute stream is ordered after the
        loads (a last whole-copy wait on each costs nothing and covers a layer skipped)."""
        for op in self._ops:
            op.make_stream_wait()
        self._ops.clear()

    def wait_all(self) -> None:
        self.whole_waits += len(self._ops)
        self.end_forward()


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
        flat = index.reshape(-1).to(device)
        shape = (pages.numel(), host_pool.page_size, host_pool.num_kv_heads, host_pool.head_dim)
        for layer, bufs in enumerate(zip(k_buffers, v_buffers, strict=True)):
            for kv, buf in enumerate(bufs):
                rows = buf.index_select(0, flat).cpu().view(shape)
                host_pool.data[layer, :, kv].index_copy_(0, pages, rows)
        return CopyOp(pages.numel() * host_pool.bytes_per_page, time.perf_counter() - t0)

    def _load(self, host_pool, pages, k_buffers, v_buffers, index, after) -> CopyOp:
        device = k_buffers[0].device
        t0 = self._start(device, after)
        flat = index.reshape(-1).to(device)
        heads = (host_pool.num_kv_heads, host_pool.head_dim)
        for layer, bufs in enumerate(zip(k_buffers, v_buffers, strict=True)):
            for kv, buf in enumerate(bufs):
                rows = host_pool.data[layer, :, kv].index_select(0, pages).view(-1, *heads)
                buf.index_copy_(0, flat, rows.to(device))
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
    current stream (and for the ``after`` ops), then, layer by layer, gathers / scatters on its
    stream and moves the bytes with non-blocking transfers from / into the pinned host pool,
    so the CPU never waits. A load records ``layer_events[l]`` once layer ``l``'s K and V are in
    place: the layers cross the bus in order, each scattered from the staging tensor right after
    its transfer, so the first event fires after ``1 / num_layers`` of the bytes (in a copy cut
    into chunks, after the layer's last chunk).

    Each direction keeps its staging buffer (up to ``max_staging_bytes``) between copies, so
    steady-state copies allocate no device memory (a first allocation can synchronize the
    device). Device slots given as a CPU tensor are pinned (torch's caching host allocator, as
    in ``tensor_to_device``) and sent ahead on the side stream; a pinned block of a new size can
    also synchronize, so hot paths pass CUDA slot tensors.
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
        # per stream: a flat uint8 buffer on `device`, one layer of a chunk of pages
        self._staging_buffers: dict[torch.cuda.Stream, torch.Tensor] = {}

    def _write(self, k_buffers, v_buffers, index, host_pool, pages, after) -> CopyOp:
        stream, start, end = self._begin(self.write_stream, k_buffers, host_pool, after)
        with torch.cuda.stream(stream):
            start.record(stream)
            index = self._to_device(index, stream)
            for lo, hi in self._chunks(pages.numel(), host_pool):
                runs = host_pool.page_runs(pages[lo:hi])
                staged = self._staging(stream, hi - lo, host_pool)
                for layer, bufs in enumerate(zip(k_buffers, v_buffers, strict=True)):
                    _gather_layer(bufs, index[lo:hi], staged)
                    for page, offset, count in runs:
                        host_pool.data[layer, page : page + count].copy_(
                            staged[offset : offset + count], non_blocking=True
                        )
            end.record(stream)
        num_bytes = pages.numel() * host_pool.bytes_per_page
        return CudaCopyOp(num_bytes, self.device, start, end, [], (index,))

    def _load(self, host_pool, pages, k_buffers, v_buffers, index, after) -> CopyOp:
        stream, start, end = self._begin(self.load_stream, k_buffers, host_pool, after)
        layer_events = [torch.cuda.Event() for _ in k_buffers]
        chunks = [
            (lo, hi, host_pool.page_runs(pages[lo:hi]))
            for lo, hi in self._chunks(pages.numel(), host_pool)
        ]
        with torch.cuda.stream(stream):
            start.record(stream)
            index = self._to_device(index, stream)
            for layer, bufs in enumerate(zip(k_buffers, v_buffers, strict=True)):
                for lo, hi, runs in chunks:
                    staged = self._staging(stream, hi - lo, host_pool)
                    for page, offset, count in runs:
                        staged[offset : offset + count].copy_(
                            host_pool.data[layer, page : page + count], non_blocking=True
                        )
                    _scatter_layer(staged, bufs, index[lo:hi])
                layer_events[layer].record(stream)
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
    ) -> torch.Tensor:
        """A view of ``stream``'s staging buffer for one layer of ``num_pages`` pages
        (:func:`_layer_shape`), called inside ``stream``'s context: a buffer that grows is
        freed to that stream and only reused in its order."""
        num_bytes = num_pages * host_pool.bytes_per_page // host_pool.num_layers
        buffer = self._staging_buffers.get(stream)
        if buffer is None or buffer.numel() < num_bytes:
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            self._staging_buffers[stream] = buffer
        return buffer[:num_bytes].view(host_pool.dtype).view(_layer_shape(num_pages, host_pool))

    def _chunks(self, num_pages: int, host_pool: HostKVPool) -> list[tuple[int, int]]:
        bytes_per_layer_page = host_pool.bytes_per_page // host_pool.num_layers
        per_chunk = max(1, self.max_staging_bytes // bytes_per_layer_page)
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


def _layer_shape(num_pages: int, host_pool: HostKVPool) -> tuple[int, ...]:
    """One layer of ``num_pages`` host pages: ``[pages, 2, page_size, num_kv_heads, head_dim]``."""
    return (num_pages, 2, host_pool.page_size, host_pool.num_kv_heads, host_pool.head_dim)


def _gather_layer(
    bufs: tuple[torch.Tensor, torch.Tensor], index: torch.Tensor, staged: torch.Tensor
) -> None:
    """One layer's K and V at ``index`` ([pages, page_size] int64, on the buffers' device) into
    ``staged`` ([pages, 2, page_size, heads, head_dim])."""
    for kv, buf in enumerate(bufs):
        staged[:, kv] = buf[index]


def _scatter_layer(
    staged: torch.Tensor, bufs: tuple[torch.Tensor, torch.Tensor], index: torch.Tensor
) -> None:
    """The inverse of :func:`_gather_layer`: ``staged``'s K and V into the buffers at ``index``."""
    for kv, buf in enumerate(bufs):
        buf.index_put_((index,), staged[:, kv])
