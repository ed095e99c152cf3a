"""Host-to-device copies that do not wait for the GPU.

A plain ``torch.tensor(values, device="cuda")`` or ``cpu_tensor.to("cuda")`` synchronizes the
stream (a copy from pageable memory), so the CPU would wait for the running forward pass before
it could prepare the next one. Staging through pinned memory and copying with
``non_blocking=True`` queues the copy behind that work instead (the caching host allocator keeps
the staging buffer alive until the copy has run). On a CPU device these are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[Sequence[int]],
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def tensor_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device)`` for a host tensor, without a stream sync on CUDA."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostReadback:
    """A device tensor copied to pinned host memory behind the work already queued, readable
    once that work has run: ``ready()`` asks without waiting, ``wait()`` blocks."""

    def __init__(self, t: torch.Tensor):
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        return self.event.query()

    def wait(self) -> torch.Tensor:
        self.event.synchronize()
        return self.host
