"""KV memory: the request-to-token table, the per-layer K/V pool of token slots, the slot allocator.

Slot 0 of the K/V pool is a padding slot that is never handed out: padded entries of index
tensors point at it, so kernels can read it harmlessly. Usable slots are ``1..max_total_tokens``.

FP8 KV (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``). The pool stores one byte per value and keeps
the model's dtype as its compute dtype: ``set_kv`` takes K/V in any float dtype and stores
``saturate(x / scale)``; a reader dequantises what it gathers as ``stored * scale`` (kernels
load the fp8 values, convert them in registers and fold the scale into the softmax scale for K
and into the output for V). There is never a dequantised copy of the pool.

Scales: one static ``k_scale`` and ``v_scale`` per layer (per-tensor), as Python floats. The
runner sets them once at start-up, before any request runs (``--kv-cache-scales``: calibrated by
``executor/kv_calibration.py`` by default, all 1.0 with ``unit``, or read from a JSON file):
:meth:`KVPool.recording_amax` records each layer's largest |K| and |V| as ``set_kv`` is given
them (before quantisation) during the calibration forward, and :meth:`KVPool.set_scales`
installs the scales, refused once a token has been written outside such a recording. Why per
layer and static: a stored byte is only meaningful with the scale it was written with, so a
scale can never change once tokens are written (a running amax would re-scale old tokens
wrongly), and pages moved to the host or disk tier must read back with the same scale in a later
process, which a constant does and a data-dependent one would not (the disk tier's fingerprint
includes the scales). Per-head scales would buy little (e4m3 is a floating-point format: its
relative error, 2^-4, is the same at every magnitude of its normal range, 2^-6..448 times the
scale, so a scale only has to keep values inside that range) and FlashInfer's paged kernels take
one scalar scale per tensor. Floats rather than device tensors: they are constants of captured
CUDA graphs and cost no device-to-host read.

Range: e4m3 holds |x| <= 448 (e5m2: 57344) times the scale. A random-init model may produce
larger K/V; a write never yields inf/NaN: values beyond the range saturate to +-max (the output
stays finite, with the clipped values' error). Below the normal range precision is absolute
(e4m3: steps of 2^-9 * scale). On SmolLM2-135M |K| < 19 and |V| < 12 in every layer, so a scale
of 1.0 never saturates, but 44% of layer 0's V (median 0.018) lies below 2^-6; calibrated scales
bring those into the normal range, which changes this model's outputs little (measured in
``kv_calibration.py``: e4m3's 3-bit mantissa dominates the error).
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from radixlm.hicache.copy_engine import LayerLoads
from radixlm.srt.executor.transfer import HostReadback, tensor_to_device


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled buffer. On the CPU it is backed by an anonymous memory map: the kernel hands
    out zero pages when they are first touched, so a pool of gigabytes costs nothing at start-up
    (``torch.zeros`` writes every byte, seconds per GiB on a virtual machine) and the process's
    resident memory grows with the KV actually written rather than with the pool's size."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # as malloc: copy-on-write on fork
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


class ReqToTokenPool:
    """Maps ``(req_slot, position) -> kv_slot`` for every running request.

    Row 0 is a padding row that is never handed out: it stays all zeros (the padding KV slot),
    for padded rows of fixed-size batches such as CUDA-graph replays.
    """

    PADDING_ROW = 0

    def __init__(self, num_req_slots: int, max_context_len: int, device: torch.device):
        # [num_req_slots + 1, max_context_len] int64 on `device`; 0 where unused (the padding slot)
        self.req_to_token = torch.zeros(
            (num_req_slots + 1, max_context_len), dtype=torch.int64, device=device
        )
        self.num_req_slots = num_req_slots
        self.max_context_len = max_context_len
        self._free = list(range(num_req_slots, 0, -1))
        # tensor parallelism, rank 0: (req_slot, start, kv_slots) of every write since the last
        # step, start -1 for a freed row; executor/tp_sync.py replays them on the other ranks
        self.journal: list[tuple[int, int, torch.Tensor]] | None = None

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, req_slot: int) -> None:
        self.req_to_token[req_slot].zero_()
        self._free.append(req_slot)
        if self.journal is not None:
            self.journal.append((req_slot, -1, self.req_to_token.new_empty(0)))

    def write(self, req_slot: int, start: int, kv_slots: torch.Tensor) -> None:
        self.req_to_token[req_slot, start : start + len(kv_slots)] = kv_slots
        if self.journal is not None:
            self.journal.append((req_slot, start, kv_slots))

    def read(self, req_slot: int, end: int, start: int = 0) -> torch.Tensor:
        return self.req_to_token[req_slot, start:end]


FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MIN_FP8_CUDA_CAPABILITY = (8, 9)  # Ada / Hopper: hardware fp8 conversions (Triton, FlashInfer)


def kv_storage_dtype(
    kv_cache_dtype: str, dtype: torch.dtype, quantization: str, device: torch.device
) -> torch.dtype:
    """The KV pool's storage dtype for the ``kv_cache_dtype`` option (``auto``: the model's
    ``dtype``); ValueError naming kv_cache_dtype when it cannot run with this quantization or
    on this device."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of auto, {', '.join(FP8_KV_DTYPES)}; got {kv_cache_dtype!r}"
        )
    if quantization == "int4":
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} cannot be combined with quantization int4; "
            "use kv_cache_dtype auto or quantization none"
        )
    storage = FP8_KV_DTYPES[kv_cache_dtype]
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_FP8_CUDA_CAPABILITY:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype} needs a GPU with fp8 support (compute "
                f"capability >= 8.9), {device} has {capability[0]}.{capability[1]}; "
                "use kv_cache_dtype auto"
            )
    _probe_fp8(storage, dtype, device, kv_cache_dtype)
    return storage


def _probe_fp8(
    storage: torch.dtype, dtype: torch.dtype, device: torch.device, kv_cache_dtype: str
) -> None:
    """Writes and reads two values through the pool's fp8 path; ValueError if torch cannot."""
    try:
        pool = KVPool(2, 1, 1, 2, dtype, device, storage_dtype=storage)
        x = torch.tensor([[[1.5, -1e9]]], dtype=dtype, device=device)
        pool.set_kv(0, torch.tensor([1], device=device), x, x)
        back = pool.k_buffers[0][1].to(torch.float32).cpu()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} is not supported on {device} by this torch "
            f"({e}); use kv_cache_dtype auto"
        ) from e
    if back[0, 0] != 1.5 or back[0, 1] != -torch.finfo(storage).max:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype}: {device} does not round-trip fp8 values; "
            "use kv_cache_dtype auto"
        )


class KVPool:
    """Per-layer K and V buffers of shape ``[max_total_tokens + 1, num_kv_heads, head_dim]``.

    ``dtype`` is the compute dtype (what ``set_kv`` is given and readers compute in);
    ``storage_dtype`` is the buffers' dtype: ``dtype`` itself (the default) or an fp8 dtype, in
    which case each layer has a static ``k_scales[l]`` / ``v_scales[l]`` (see the module
    docstring): stored = saturate(value / scale), value ~= stored * scale.
    """

    def __init__(
        self,
        max_total_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        storage_dtype: torch.dtype | None = None,
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ):
        self.max_total_tokens = max_total_tokens
        self.num_layers = num_layers
        self.dtype = dtype
        self.storage_dtype = dtype if storage_dtype is None else storage_dtype
        self.is_quantized = self.storage_dtype in FP8_KV_DTYPES.values()
        if self.storage_dtype != dtype and not self.is_quantized:
            raise ValueError(f"KV storage dtype {self.storage_dtype} is neither {dtype} nor fp8")
        self.k_scales = _scales(k_scales, num_layers, "k_scales", self.is_quantized)
        self.v_scales = _scales(v_scales, num_layers, "v_scales", self.is_quantized)
        self.has_written_tokens = False  # a set_kv outside recording_amax: the scales are final
        # inside recording_amax: [2, num_layers] float32 on `device`, the max |K| (row 0) and
        # |V| (row 1) given to set_kv per layer; None otherwise (set_kv pays nothing for it)
        self._amax: torch.Tensor | None = None
        self.device = device
        shape = (max_total_tokens + 1, num_kv_heads, head_dim)
        # per layer: [max_total_tokens + 1, num_kv_heads, head_dim] storage_dtype on `device`
        self.k_buffers = [zeros(shape, self.storage_dtype, device) for _ in range(num_layers)]
        self.v_buffers = [zeros(shape, self.storage_dtype, device) for _ in range(num_layers)]
        # host -> device copies (HiCache load-backs) the next forward waits for per layer;
        # always empty without a host tier
        self.layer_loads = LayerLoads()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K and V of one token in every layer, stored as ``dtype`` (the storage dtype)."""
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    def set_kv(
        self, layer_id: int, kv_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Stores ``k``/``v`` ``[n, num_kv_heads, head_dim]`` at ``kv_slots`` ``[n]`` (quantised
        and saturated for an fp8 pool)."""
        if self._amax is not None:
            self._record_amax(layer_id, k, v)
        else:
            self.has_written_tokens = True
        if not self.is_quantized:
            self.k_buffers[layer_id][kv_slots] = k.to(self.dtype)
            self.v_buffers[layer_id][kv_slots] = v.to(self.dtype)
            return
        # byte views: indexed writes of float8 tensors are not implemented on every device
        k8 = quantize_fp8(k, self.k_scales[layer_id], self.storage_dtype)
        v8 = quantize_fp8(v, self.v_scales[layer_id], self.storage_dtype)
        self.k_buffers[layer_id].view(torch.uint8)[kv_slots] = k8.view(torch.uint8)
        self.v_buffers[layer_id].view(torch.uint8)[kv_slots] = v8.view(torch.uint8)

    def direct_write_target(
        self, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
        """``(k_buffer, v_buffer, k_scale, v_scale)`` of the layer for a kernel that writes the new
        tokens' K/V into the pool itself, as ``set_kv`` would (``fused.rope_qkv_store``), or None
        while :meth:`recording_amax` runs (the values must pass through ``set_kv`` then). Like
        ``set_kv`` it counts as a write: the scales are final from then on."""
        if self._amax is not None:
            return None
        self.has_written_tokens = True
        return (
            self.k_buffers[layer_id],
            self.v_buffers[layer_id],
            self.k_scales[layer_id],
            self.v_scales[layer_id],
        )

    @contextlib.contextmanager
    def recording_amax(self) -> Iterator[KVAmax]:
        """Records the largest |K| and |V| that ``set_kv`` is given per layer (before any
        quantisation) until the block exits, when the yielded :class:`KVAmax` is filled in (one
        device-to-host read). For the start-up calibration: writes inside the block do not count
        as written tokens for :meth:`set_scales` (the caller frees their slots)."""
        if self._amax is not None:
            raise RuntimeError("recording_amax blocks do not nest")
        record = KVAmax()
        self._amax = torch.zeros((2, self.num_layers), dtype=torch.float32, device=self.device)
        try:
            yield record
        finally:
            amax, self._amax = self._amax, None
            record.k, record.v = amax.tolist()

    def _record_amax(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self._amax is not None
        for row, x in enumerate((k, v)):
            if x.numel():  # the max of the values is one of them: exact in any float dtype
                m = x.detach().abs().amax().to(torch.float32)
                self._amax[row, layer_id] = torch.maximum(self._amax[row, layer_id], m)

    def set_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """Installs per-layer scales (one positive finite float per layer; anything but 1.0 needs
        an fp8 pool). Start-up only: refused once a token has been written outside
        :meth:`recording_amax`, since a stored byte keeps the scale it was written with."""
        if self.has_written_tokens:
            raise RuntimeError("KV scales can only be set before any token is written to the pool")
        k = _scales(k_scales, self.num_layers, "k_scales", self.is_quantized)
        v = _scales(v_scales, self.num_layers, "v_scales", self.is_quantized)
        self.k_scales, self.v_scales = k, v

    def wait_loaded(self, layer_id: int) -> None:
        """Called by each attention layer of a forward before it writes or reads the layer's
        KV: the compute stream waits for that layer of the loads still in flight."""
        self.layer_loads.wait_layer(layer_id)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V buffers, in ``storage_dtype`` (dequantise with ``get_scales``)."""
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def get_scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of the layer: a stored value times its scale is the real value
        (1.0, 1.0 for an unquantised pool)."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def scales_info(self) -> dict[str, list[float]] | None:
        """``{"k": k_scales, "v": v_scales}`` (one float per layer) of an fp8 pool, else None."""
        return {"k": list(self.k_scales), "v": list(self.v_scales)} if self.is_quantized else None

    def transfer_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The per-layer buffers as tier copies (HiCache) move them: fp8 ones as ``uint8`` views
        of the same memory (the bytes are what travels; torch has no CPU ``index_copy_`` for
        float8), others as they are. Their dtype is :attr:`transfer_dtype`."""
        if not self.is_quantized:
            return list(self.k_buffers), list(self.v_buffers)
        return (
            [b.view(torch.uint8) for b in self.k_buffers],
            [b.view(torch.uint8) for b in self.v_buffers],
        )

    @property
    def transfer_dtype(self) -> torch.dtype:
        return torch.uint8 if self.is_quantized else self.storage_dtype


@dataclass
class KVAmax:
    """Per-layer max |K| and |V| given to ``set_kv`` in a :meth:`KVPool.recording_amax` block,
    filled in when the block exits (0.0 for a layer nothing was written to; inf or NaN if the
    model produced them)."""

    k: list[float] = field(default_factory=list)
    v: list[float] = field(default_factory=list)


def quantize_fp8(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in ``fp8_dtype``, round to nearest, saturated to the format's range (no
    inf or NaN from finite or infinite input)."""
    finite_max = torch.finfo(fp8_dtype).max
    y = x if scale == 1.0 else x.to(torch.float32) / scale
    return y.clamp(-finite_max, finite_max).to(fp8_dtype)


def _scales(
    values: Sequence[float] | None, num_layers: int, name: str, is_quantized: bool
) -> list[float]:
    if values is None:
        return [1.0] * num_layers
    out = [float(s) for s in values]
    if len(out) != num_layers:
        raise ValueError(f"{name} has {len(out)} entries for {num_layers} layers")
    if not is_quantized and any(s != 1.0 for s in out):
        raise ValueError(f"{name} other than 1.0 need an fp8 KV storage dtype")
    if not all(math.isfinite(s) and s > 0 for s in out):
        raise ValueError(f"{name} must be finite and > 0, got {out}")
    return out


class TokenSlotAllocator:
    """Hands out KV slots ``1..max_total_tokens`` in whole pages of ``page_size`` slots.

    With ``page_size > 1`` a request's tokens fill its last page before a new page is taken
    (:meth:`alloc_for`), so every page belongs to one request; ``free`` takes the slots of whole
    pages back (a page is free again when all its slots are).

    Freeing slots held in a CUDA tensor does not wait for the GPU (that would stall the
    overlapped scheduler on every step where a request finishes): their values are copied to
    the host behind the queued work and the pages come back once that copy has run, which
    ``available_size`` checks without waiting. ``collect_freed(wait=True)`` takes them all back
    (when memory is short, and before any accounting that must be exact).
    """

    def __init__(self, max_total_tokens: int, page_size: int, device: torch.device):
        if max_total_tokens % page_size:
            max_total_tokens -= max_total_tokens % page_size
        self.max_total_tokens = max_total_tokens
        self.page_size = page_size
        self.device = device
        num_pages = max_total_tokens // page_size
        # free page ids; page p covers slots 1 + p*page_size ... (p+1)*page_size
        self._free_pages = FreePages(num_pages)
        self._pending: deque[HostReadback] = deque()  # freed slots still on their way to the host

    def available_size(self) -> int:
        self.collect_freed(wait=False)
        return len(self._free_pages) * self.page_size

    def collect_freed(self, wait: bool = True) -> None:
        """Returns the pages of freed device slots whose host copy has arrived (all of them,
        waiting for the copies, with ``wait``)."""
        while self._pending and (wait or self._pending[0].ready()):
            self._free_host(self._pending.popleft().wait())

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Fresh pages for ``num_tokens`` slots (the tail of the last page stays unused)."""
        return self.alloc_for(num_tokens, last_slot=0, used_len=0)

    def alloc_for(self, num_tokens: int, last_slot: int, used_len: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` new tokens of a sequence whose last slot is ``last_slot``
        after ``used_len`` tokens; continues its partly filled last page first."""
        slots = self.alloc_for_host(num_tokens, last_slot, used_len)
        return None if slots is None else tensor_to_device(slots, self.device)

    def alloc_for_host(self, num_tokens: int, last_slot: int, used_len: int) -> torch.Tensor | None:
        """:meth:`alloc_for`, with the slots in a CPU tensor."""
        ps = self.page_size
        tail = (ps - used_len % ps) % ps if used_len else 0
        from_tail = min(tail, num_tokens)
        need_pages = -(-(num_tokens - from_tail) // ps)
        if need_pages > len(self._free_pages):
            return None
        parts = []
        if from_tail:
            parts.append(torch.arange(last_slot + 1, last_slot + 1 + from_tail, dtype=torch.int64))
        pages = [self._free_pages.pop() for _ in range(need_pages)]
        if pages:
            starts = torch.tensor(pages, dtype=torch.int64) * ps + 1
            parts.append((starts[:, None] + torch.arange(ps)).flatten()[: num_tokens - from_tail])
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(parts)

    def free(self, kv_slots: torch.Tensor) -> None:
        """Frees the pages that ``kv_slots`` start or cover (callers free whole sequences' pages)."""
        if kv_slots.numel() == 0:
            return
        if kv_slots.device.type == "cuda":
            self._pending.append(HostReadback(kv_slots))
        else:
            self._free_host(kv_slots)

    def _free_host(self, kv_slots: torch.Tensor) -> None:
        self._free_pages.extend(torch.unique((kv_slots - 1) // self.page_size).tolist())

    def check_integrity(self) -> None:
        self.collect_freed()
        self._free_pages.check()
        assert len(self._free_pages) * self.page_size <= self.max_total_tokens


class FreePages:
    """The free page ids as a stack: pages given back are handed out again first (last in,
    first out), then the pages never handed out, in ascending order. Those are a range, not a
    list: a CPU pool sized by its memory budget has millions of pages (a list of them took
    seconds to build and a hundred MiB to hold)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.next_fresh = 0  # pages next_fresh .. num_pages - 1 were never handed out
        self.returned: list[int] = []

    def __len__(self) -> int:
        return len(self.returned) + self.num_pages - self.next_fresh

    def __iter__(self) -> Iterator[int]:
        yield from range(self.num_pages - 1, self.next_fresh - 1, -1)
        yield from self.returned

    def pop(self) -> int:
        if self.returned:
            return self.returned.pop()
        if self.next_fresh == self.num_pages:
            raise IndexError("pop from an empty page stack")
        self.next_fresh += 1
        return self.next_fresh - 1

    def extend(self, pages: Iterable[int]) -> None:
        self.returned.extend(pages)

    def check(self) -> None:
        """Every free page once: none given back twice, none given back unhanded."""
        assert len(set(self.returned)) == len(self.returned), "page freed twice"
        assert all(0 <= p < self.next_fresh for p in self.returned), "a free page freed"
