"""The contract of a KV transfer engine, and what both sides of a pair must agree on.

A transfer engine moves bytes from this process's registered memory into a peer's registered
memory (one-sided writes: the prefill worker writes, the decode worker's engine receives
without a call of its own). Both sides register their KV pool buffers at start-up; a peer is
named by its ``session_id`` (``host:port`` of the engine's own handshake listener), which the
decode worker sends to the prefill worker in its registration (``handshake.py``).

Implementations: Mooncake's transfer engine (``mooncake.py``). Another engine (NIXL) is one
more class with the three methods below, registered in ``make_transfer_engine``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch


class TransferEngine(Protocol):
    """One engine per process; ``write_batch`` is called from the scheduler thread only."""

    name: str
    session_id: str  # how peers name this engine ("host:port")

    def register(self, buffers: list[torch.Tensor]) -> None:
        """Registers whole buffers (contiguous, pinned for the process's life) for transfers."""

    def write_batch(
        self, peer: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]
    ) -> None:
        """Writes ``lengths[i]`` bytes from local ``src_addrs[i]`` to the peer's ``dst_addrs[i]``
        and returns once all have landed; raises TransferError when any did not."""


class TransferError(RuntimeError):
    """A transfer that did not complete (peer gone, unregistered memory, transport error)."""


@dataclass(frozen=True)
class KVLayout:
    """Where a KV pool's bytes are and what they mean; two workers pair only when their
    ``fingerprint`` is equal (same model, dtype, page size, heads, head size and layers)."""

    k_addrs: tuple[int, ...]  # per layer: the address of slot 0 of the K buffer
    v_addrs: tuple[int, ...]
    slot_bytes: int  # one token's K (or V) in one layer
    page_size: int
    fingerprint: str

    @classmethod
    def of_pool(
        cls,
        k_buffers: list[torch.Tensor],
        v_buffers: list[torch.Tensor],
        page_size: int,
        model: str,
        scales: object = None,
    ) -> KVLayout:
        """``k_buffers``/``v_buffers``: per layer ``[num_slots, kv_heads, head_dim]``."""
        first = k_buffers[0]
        slot_bytes = first[0].numel() * first.element_size()
        desc = (
            f"model={model};layers={len(k_buffers)};shape={tuple(first.shape[1:])};"
            f"dtype={first.dtype};page={page_size};scales={scales}"
        )
        digest = hashlib.blake2b(desc.encode(), digest_size=12).hexdigest()
        return cls(
            tuple(b.data_ptr() for b in k_buffers),
            tuple(b.data_ptr() for b in v_buffers),
            slot_bytes,
            page_size,
            f"{digest}:{desc}",
        )


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs over which both slot lists are contiguous: pages of
    ``page_size`` tokens (or longer runs) become one write each."""
    assert len(src) == len(dst)
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def kv_writes(
    local: KVLayout,
    remote_k: list[int],
    remote_v: list[int],
    src_slots: list[int],
    dst_slots: list[int],
) -> tuple[list[int], list[int], list[int]]:
    """The (src, dst, length) byte ranges that copy ``src_slots`` of every layer's K and V into
    the peer's ``dst_slots`` (same layout: the fingerprints matched)."""
    b = local.slot_bytes
    srcs, dsts, lens = [], [], []
    runs = slot_runs(src_slots, dst_slots)
    for local_addrs, peer_addrs in ((local.k_addrs, remote_k), (local.v_addrs, remote_v)):
        for base, peer_base in zip(local_addrs, peer_addrs, strict=True):
            for s, d, n in runs:
                srcs.append(base + s * b)
                dsts.append(peer_base + d * b)
                lens.append(n * b)
    return srcs, dsts, lens


def make_transfer_engine(
    backend: str, host: str, transport: str, ib_device: str | None
) -> TransferEngine:
    """The engine ``--disaggregation-transfer-backend`` names; a ValueError saying what is
    missing when it cannot start here."""
    if backend == "mooncake":
        from radixlm.srt.disaggregation.mooncake import MooncakeEngine

        return MooncakeEngine(host, transport, ib_device)
    raise ValueError(f"unknown transfer backend {backend!r}; known: mooncake")
