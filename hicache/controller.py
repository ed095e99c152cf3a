"""What the HiCache-aware tree calls to move KV between the device and the host tier.

:class:`HiCacheController` issues copies through a :class:`CopyEngine`, orders copies that
touch the same host pages (a load of pages that a pending write fills waits for that write; a
write into pages that a pending load still reads waits for that load), and measures the copy
bandwidth in both directions so the tree can tell whether loading a prefix beats recomputing it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlm.hicache.copy_engine import CopyEngine, CopyOp, LayerLoads, make_copy_engine
from radixlm.hicache.host_pool import HostKVPool

DEFAULT_CALIBRATION_BYTES = 64 * 2**20  # smaller copies are dominated by launch overhead
DEFAULT_HALF_LIFE_BYTES = 32 * 2**20


class BandwidthMeter:
    """An exponential moving average of bytes per second, weighted by bytes: an op of
    ``half_life_bytes`` moves the estimate halfway to its own rate, a tiny op (whose time is
    mostly fixed overhead) barely moves it."""

    def __init__(self, bytes_per_s: float, half_life_bytes: float = DEFAULT_HALF_LIFE_BYTES):
        self.bytes_per_s = bytes_per_s
        self.half_life_bytes = half_life_bytes

    def update(self, num_bytes: int, seconds: float | None) -> None:
        if not seconds or seconds <= 0 or num_bytes <= 0:
            return
        weight = 1.0 - 0.5 ** (num_bytes / self.half_life_bytes)
        self.bytes_per_s += weight * (num_bytes / seconds - self.bytes_per_s)


@dataclass
class _Pending:
    op: CopyOp
    pages: torch.Tensor  # [n] int64 CPU: the host pages the op reads or writes


class HiCacheController:
    """Copies between the device KV buffers and ``host_pool``; counts and times them.

    ``k_buffers[l]`` / ``v_buffers[l]``: the runtime's per-layer KV buffers
    (``[num_slots, num_kv_heads, head_dim]``). ``engine`` defaults to the asynchronous CUDA
    engine for CUDA buffers and a pinned pool, else the synchronous one. At construction up
    to ``calibration_bytes`` of pages are copied both ways between scratch tensors (never the
    live buffers) to seed the bandwidth estimates; completed ops then refine them. Bandwidths
    are in bytes per second of KV payload, times in seconds. Statistics count ops when they
    are seen complete (``poll``, ``synchronize``, or the next ``write_back`` / ``load_back`` /
    ``stats`` call).

    The caller keeps the rest of :class:`CopyEngine`'s contract: a written-back op's device
    slots stay unchanged until it is done (or the compute stream is made to wait for it); a
    loaded op's device slots are read only after ``op.make_stream_wait()`` or, by the forward,
    per layer through ``layer_loads`` (the KV pool's :class:`LayerLoads`, where the tree adds
    its loads); host slots of an unfinished op are neither freed nor read through
    ``page_bytes``.
    """

    def __init__(
        self,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        host_pool: HostKVPool,
        engine: CopyEngine | None = None,
        calibration_bytes: int = DEFAULT_CALIBRATION_BYTES,
        half_life_bytes: float = DEFAULT_HALF_LIFE_BYTES,
        layer_loads: LayerLoads | None = None,
    ):
        host_pool.check_buffers(k_buffers, v_buffers)
        self.layer_loads = layer_loads if layer_loads is not None else LayerLoads()
        self.k_buffers = list(k_buffers)
        self.v_buffers = list(v_buffers)
        self.host_pool = host_pool
        self.device = self.k_buffers[0].device
        self.engine = engine if engine is not None else make_copy_engine(self.device, host_pool)
        self._pending_loads: deque[_Pending] = deque()
        self._pending_writes: deque[_Pending] = deque()
        self.loaded_bytes = 0
        self.written_bytes = 0
        self.load_ops = 0
        self.write_ops = 0
        write_bps, load_bps = self._calibrate(calibration_bytes)
        self._write_meter = BandwidthMeter(write_bps, half_life_bytes)
        self._load_meter = BandwidthMeter(load_bps, half_life_bytes)

    @property
    def bytes_per_token(self) -> int:
        return self.host_pool.bytes_per_token

    # ------------------------------------------------------------------------------ copies

    def write_back(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> CopyOp:
        """Copies the KV at ``device_slots`` into ``host_slots`` (whole host pages)."""
        self.poll()
        pages = self.host_pool.page_ids(host_slots)
        after = _overlapping(self._pending_loads, pages)
        op = self.engine.write(
            self.k_buffers, self.v_buffers, device_slots, self.host_pool, host_slots, after
        )
        self._pending_writes.append(_Pending(op, pages))
        return op

    def load_back(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> CopyOp:
        """Copies the KV in ``host_slots`` (whole host pages) to ``device_slots``."""
        self.poll()
        pages = self.host_pool.page_ids(host_slots)
        after = _overlapping(self._pending_writes, pages)
        op = self.engine.load(
            self.host_pool, host_slots, self.k_buffers, self.v_buffers, device_slots, after
        )
        self._pending_loads.append(_Pending(op, pages))
        return op

    def poll(self) -> None:
        """Folds finished ops into the statistics, without blocking."""
        self._fold(wait=False)

    def synchronize(self) -> None:
        """Waits for every issued op and folds it into the statistics."""
        self._fold(wait=True)

    def _fold(self, wait: bool) -> None:
        # each direction completes in issue order, so stop at the first unfinished op
        while self._pending_writes and (wait or self._pending_writes[0].op.done()):
            op = self._pending_writes.popleft().op
            op.wait()
            self.written_bytes += op.num_bytes
            self.write_ops += 1
            self._write_meter.update(op.num_bytes, op.seconds)
        while self._pending_loads and (wait or self._pending_loads[0].op.done()):
            op = self._pending_loads.popleft().op
            op.wait()
            self.loaded_bytes += op.num_bytes
            self.load_ops += 1
            self._load_meter.update(op.num_bytes, op.seconds)

    # ------------------------------------------------------------------------------ bandwidth

    def load_bytes_per_s(self) -> float:
        return self._load_meter.bytes_per_s

    def write_bytes_per_s(self) -> float:
        return self._write_meter.bytes_per_s

    def estimate_load_seconds(self, num_tokens: int) -> float:
        """Seconds to load ``num_tokens`` tokens of KV from the host tier at the measured rate."""
        return num_tokens * self.bytes_per_token / self.load_bytes_per_s()

    def stats(self) -> dict[str, float]:
        self.poll()
        return {
            "loaded_bytes": self.loaded_bytes,
            "written_bytes": self.written_bytes,
            "load_ops": self.load_ops,
            "write_ops": self.write_ops,
            "load_bytes_per_s": self.load_bytes_per_s(),
            "write_bytes_per_s": self.write_bytes_per_s(),
            "pending_ops": len(self._pending_loads) + len(self._pending_writes),
        }

    def _calibrate(self, calibration_bytes: int) -> tuple[float, float]:
        """(write, load) bytes/s of copying up to ``calibration_bytes`` both ways between
        scratch tensors of the live buffers' dtype and device and a scratch host pool; the
        second of two rounds counts (the first loads kernels and grows the engine's staging
        buffers, which also keeps those one-time costs out of the first real copies)."""
        pool = self.host_pool
        num_pages = max(1, min(calibration_bytes // pool.bytes_per_page, pool.num_pages))
        num_tokens = num_pages * pool.page_size
        scratch_pool = HostKVPool(
            num_tokens,
            pool.page_size,
            pool.num_layers,
            pool.num_kv_heads,
            pool.head_dim,
            pool.dtype,
            pin_memory=pool.is_pinned,
        )
        shape = (num_tokens, pool.num_kv_heads, pool.head_dim)
        k = [torch.zeros(shape, dtype=pool.dtype, device=self.device) for _ in self.k_buffers]
        v = [torch.zeros(shape, dtype=pool.dtype, device=self.device) for _ in self.v_buffers]
        device_slots = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
        host_slots = scratch_pool.alloc(num_tokens)
        assert host_slots is not None
        rates = (0.0, 0.0)
        for _ in range(2):
            write = self.engine.write(k, v, device_slots, scratch_pool, host_slots)
            write.wait()
            load = self.engine.load(scratch_pool, host_slots, k, v, device_slots)
            load.wait()
            rates = (_rate(write), _rate(load))
        return rates


def _rate(op: CopyOp) -> float:
    seconds = max(op.seconds or 0.0, 1e-9)
    return op.num_bytes / seconds


def _overlapping(pending: deque[_Pending], pages: torch.Tensor) -> list[CopyOp]:
    """The pending ops that touch any of ``pages``."""
    return [p.op for p in pending if bool(torch.isin(pages, p.pages).any())]
