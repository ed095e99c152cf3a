"""KV memory: the request-to-token table, the per-layer K/V pool of token slots, the slot allocator.

Slot 0 of the K/V pool is a padding slot that is never handed out: padded entries of index
tensors point at it, so kernels can read it harmlessly. Usable slots are ``1..max_total_tokens``.
"""

from __future__ import annotations

from collections import deque

import torch

from radixlm.srt.executor.transfer import HostReadback, tensor_to_device


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

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, req_slot: int) -> None:
        self.req_to_token[req_slot].zero_()
        self._free.append(req_slot)

    def write(self, req_slot: int, start: int, kv_slots: torch.Tensor) -> None:
        self.req_to_token[req_slot, start : start + len(kv_slots)] = kv_slots

    def read(self, req_slot: int, end: int, start: int = 0) -> torch.Tensor:
        return self.req_to_token[req_slot, start:end]


class KVPool:
    """Per-layer K and V buffers of shape ``[max_total_tokens + 1, num_kv_heads, head_dim]``."""

    def __init__(
        self,
        max_total_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.max_total_tokens = max_total_tokens
        self.num_layers = num_layers
        self.dtype = dtype
        shape = (max_total_tokens + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    def set_kv(
        self, layer_id: int, kv_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.k_buffers[layer_id][kv_slots] = k.to(self.dtype)
        self.v_buffers[layer_id][kv_slots] = v.to(self.dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]


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
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
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
        assert len(set(self._free_pages)) == len(self._free_pages), "page freed twice"
        assert len(self._free_pages) * self.page_size <= self.max_total_tokens
