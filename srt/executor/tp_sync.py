"""The step protocol of tensor parallelism: rank 0 describes each forward, followers replay it.

Rank 0 schedules; before each forward :class:`StepSender` broadcasts what the followers need to
run the same forward on their shard of the model, as three int64 tensors (no pickle):

1. the header (:data:`HEADER_LEN` values: kind, mode, token/request/logit-row counts, journal
   sizes) over the ``wait_group`` (gloo, very long timeout: a server may idle for hours between
   steps; a follower still fails at once when rank 0's connection closes);
2. the host part over the ``cpu_group`` (gloo): the requests' rows, prefix and extend lengths,
   the logit rows, and the ``(row, start, length)`` of each request-to-token write;
3. the device part over the ``device_group`` (NCCL on GPUs): the input ids, the KV slots
   written, and the KV slots of every request-to-token write, as one device tensor. On CPUs
   parts 2 and 3 travel as one gloo message. On GPUs these stay on the device: the input ids may be the previous step's
   samples not yet read back (overlap scheduling), so nothing here waits for the GPU.

Positions are not sent: :class:`ForwardBatch` defines them as ``prefix_lens[i] ..
seq_lens[i] - 1`` for request i, and followers rebuild the batch with ``ForwardBatch.from_host``.

The request-to-token table is mirrored in two parts. A journal: rank 0's
``ReqToTokenPool.journal`` records every ``write`` (and freed row) since the last step (prefix
matches, chunk caching, allocations); followers replay them in order. Then the batch's own new
tokens: by the ``ForwardBatch`` contract request i's positions ``prefix_lens[i] ..
seq_lens[i] - 1`` hold its ``out_kv_slots`` in the table at forward time, so followers write
them last (this also covers the scheduler's batched decode write, which indexes the table
directly). Rows are read only up to ``seq_lens``, so the followers' tables hold every entry a
forward reads exactly as rank 0's does. Rank 0 decides every KV slot, so
all ranks' KV pools have the same slot layout (each rank holds its own KV heads).

A stop header ends the followers' loop. Sampling happens on rank 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from radixlm.srt.distributed import TPGroup
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.memory_pool import KVPool, ReqToTokenPool
from radixlm.srt.executor.transfer import tensor_to_device, to_device

# header: kind, mode, tokens T, requests B, logit rows L, table writes W, their slots S, 0
HEADER_LEN = 8
KIND_STEP, KIND_STOP = 1, 2
_MODE_CODES = {ForwardMode.EXTEND: 0, ForwardMode.DECODE: 1}
_MODES = {code: mode for mode, code in _MODE_CODES.items()}


@dataclass
class Step:
    """One forward as a follower received it."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, device
    out_kv_slots: torch.Tensor  # [T] int64, device
    req_slots: list[int]  # [B]
    prefix_lens: list[int]  # [B]
    extend_lens: list[int]  # [B]
    logit_rows: list[int]  # [L]

    def forward_batch(
        self, pool: ReqToTokenPool, kv_pool: KVPool, attn_backend: Any
    ) -> ForwardBatch:
        """The step as a ForwardBatch over this rank's pools (positions from the lengths); writes
        the new tokens' slots into this rank's request-to-token table first."""
        positions: list[int] = []
        rows: list[int] = []
        for row, start, ext in zip(self.req_slots, self.prefix_lens, self.extend_lens, strict=True):
            positions += range(start, start + ext)
            rows += [row] * ext
        table = pool.req_to_token
        table[to_device(rows, table.device), to_device(positions, table.device)] = self.out_kv_slots
        return ForwardBatch.from_host(
            self.mode,
            self.input_ids,
            positions,
            self.out_kv_slots,
            self.req_slots,
            self.prefix_lens,
            self.extend_lens,
            req_to_token_pool=pool,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
        )


class StepSender:
    """Rank 0's side: turns on the request-to-token journal and broadcasts each step."""

    def __init__(self, tp: TPGroup, pool: ReqToTokenPool):
        self.tp, self.pool = tp, pool
        self.device = pool.req_to_token.device
        pool.journal = []
        self.is_stopped = False

    def send(self, fb: ForwardBatch, logit_rows: list[int]) -> None:
        """Broadcasts the step ``fb`` (and the table writes since the last one) to the followers."""
        journal, self.pool.journal = self.pool.journal, []
        t, b = fb.num_tokens, fb.batch_size
        slots = [tensor_to_device(s.to(torch.int64), self.device) for _, _, s in journal]
        num_journal_slots = sum(int(s.numel()) for s in slots)
        header = [KIND_STEP, _MODE_CODES[fb.mode], t, b, len(logit_rows), len(journal)]
        header += [num_journal_slots, 0]
        host = fb.req_slots_cpu + fb.prefix_lens_cpu + fb.extend_lens_cpu + list(logit_rows)
        for row, start, s in journal:
            host += (row, start, int(s.numel()))
        device = torch.cat([fb.input_ids.to(torch.int64), fb.out_kv_slots.to(torch.int64), *slots])
        self._broadcast_header(header)
        host_t = torch.tensor(host, dtype=torch.int64)
        if self.device.type == "cpu":  # both parts over gloo: one message
            dist.broadcast(torch.cat([host_t, device]), src=0, group=self.tp.cpu_group)
            return
        dist.broadcast(host_t, src=0, group=self.tp.cpu_group)
        dist.broadcast(device, src=0, group=self.tp.device_group)

    def stop(self) -> None:
        """Ends the followers' loops (once; later calls do nothing)."""
        if not self.is_stopped:
            self.is_stopped = True
            self._broadcast_header([KIND_STOP] + [0] * (HEADER_LEN - 1))

    def _broadcast_header(self, header: list[int]) -> None:
        dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0, group=self.tp.wait_group)


class StepReceiver:
    """A follower's side: receives steps and keeps its request-to-token table in step."""

    def __init__(self, tp: TPGroup, pool: ReqToTokenPool):
        self.tp, self.pool = tp, pool
        self.device = pool.req_to_token.device

    def receive(self) -> Step | None:
        """The next step (blocking until rank 0 sends one), or None when rank 0 stopped us.
        Raises ``RuntimeError`` (from torch.distributed) when the group fails."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.tp.wait_group)
        kind, mode, t, b, num_logits, num_writes, num_write_slots, _ = header.tolist()
        if kind == KIND_STOP:
            return None
        if kind != KIND_STEP:
            raise RuntimeError(f"unknown tensor-parallel message kind {kind}")
        num_host, num_device = 3 * b + num_logits + 3 * num_writes, 2 * t + num_write_slots
        if self.device.type == "cpu":  # both parts in one gloo message
            both = torch.empty(num_host + num_device, dtype=torch.int64)
            dist.broadcast(both, src=0, group=self.tp.cpu_group)
            host, device = both[:num_host], both[num_host:]
        else:
            host = torch.empty(num_host, dtype=torch.int64)
            dist.broadcast(host, src=0, group=self.tp.cpu_group)
            device = torch.empty(num_device, dtype=torch.int64, device=self.device)
            dist.broadcast(device, src=0, group=self.tp.device_group)
        values = host.tolist()
        req_slots, prefix_lens, extend_lens = values[:b], values[b : 2 * b], values[2 * b : 3 * b]
        logit_rows = values[3 * b : 3 * b + num_logits]
        self._apply_writes(values[3 * b + num_logits :], device[2 * t :])
        return Step(
            _MODES[mode],
            device[:t],
            device[t : 2 * t],
            req_slots,
            prefix_lens,
            extend_lens,
            logit_rows,
        )

    def _apply_writes(self, triples: list[int], slots: torch.Tensor) -> None:
        """Replays rank 0's request-to-token writes, in order (``start == -1``: row freed)."""
        offset = 0
        for i in range(0, len(triples), 3):
            row, start, length = triples[i : i + 3]
            if start < 0:
                self.pool.req_to_token[row].zero_()
                continue
            self.pool.req_to_token[row, start : start + length] = slots[offset : offset + length]
            offset += length
