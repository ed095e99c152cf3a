"""The tensors one forward pass needs: the one batch type from the scheduler to the kernels.

Built only through its named constructors: ``from_scheduled`` (a scheduler's batch, in the
model runner), ``from_host`` (host lists, which ``from_scheduled`` flattens to; tests use it
directly), ``for_graph_capture`` / ``graph_view`` (the static decode batch a CUDA graph is
captured on and replayed from) and ``as_decode_rows`` (a short extend, e.g. a speculative verify,
recast as one decode row per new token so that it can run through the decode graphs).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.srt.executor.transfer import tensor_to_device, to_device

if TYPE_CHECKING:
    from radixlm.kernels.attention.base import AttentionBackend
    from radixlm.srt.executor.memory_pool import KVPool, ReqToTokenPool
    from radixlm.srt.scheduler.batch import ScheduledBatch  # annotation only: a higher layer


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new tokens (a prompt or a chunk of one) on top of cached ones
    DECODE = "decode"  # exactly one new token per request

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One batch of B requests holding T new tokens in total (T == B for decode).

    Token-level tensors are ordered request by request. ``prefix_lens[i] + extend_lens[i] ==
    seq_lens[i]``; positions of request i's new tokens are ``prefix_lens[i] .. seq_lens[i]-1``.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device
    out_kv_slots: torch.Tensor  # [T] int64, device: where the new tokens' K/V are written
    req_slots: torch.Tensor  # [B] int64, device: rows of req_to_token
    req_slots_cpu: list[int]
    seq_lens: torch.Tensor  # [B] int64, device
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    attn_backend: AttentionBackend | None  # None only in kernel tests that plan by hand

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_host(
        cls,
        mode: ForwardMode,
        input_ids: list[int] | torch.Tensor,
        positions: list[int],
        out_kv_slots: torch.Tensor,
        req_slots: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        *,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        attn_backend: AttentionBackend | None,
    ) -> ForwardBatch:
        """A batch from host lists (one entry per request, tokens flattened), copied to the
        pools' device without a stream sync. ``input_ids`` may already be a device tensor (the
        previous step's samples, not yet read back)."""
        dev = req_to_token_pool.req_to_token.device
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        return cls(
            mode=mode,
            input_ids=input_ids
            if isinstance(input_ids, torch.Tensor)
            else to_device(input_ids, dev),
            positions=to_device(positions, dev),
            out_kv_slots=tensor_to_device(out_kv_slots, dev),
            req_slots=to_device(req_slots, dev),
            req_slots_cpu=req_slots,
            seq_lens=to_device(seq_lens, dev),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
        )

    @classmethod
    def one_prompt(
        cls,
        token_ids: list[int],
        req_slot: int,
        kv_slots: torch.Tensor,
        *,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
    ) -> ForwardBatch:
        """The planned extend batch of one whole prompt (no cached prefix) in the request row
        ``req_slot``, its KV written to ``kv_slots`` (recorded in the row first): the start-up
        checks' forward (quantisation check, KV calibration), outside the scheduler."""
        n = len(token_ids)
        req_to_token_pool.write(req_slot, 0, kv_slots)
        fb = cls.from_host(
            ForwardMode.EXTEND,
            token_ids,
            list(range(n)),
            kv_slots,
            [req_slot],
            [0],
            [n],
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
        )
        attn_backend.plan(fb)
        return fb

    @classmethod
    def from_scheduled(
        cls,
        batch: ScheduledBatch,
        *,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
        input_ids_on_device: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """The forward batch of a scheduler's batch: request i computes ``extend_lens[i]`` new
        tokens on top of ``starts[i]`` cached ones, written to ``slots[i]``."""
        ids = batch.input_ids() if input_ids_on_device is None else input_ids_on_device
        return cls.from_host(
            batch.mode,
            ids,
            batch.positions(),
            torch.cat(batch.slots),
            [r.req_slot for r in batch.reqs],
            list(batch.starts),
            list(batch.extend_lens),
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
        )

    @classmethod
    def for_graph_capture(
        cls,
        max_batch_size: int,
        padding_req_slot: int,
        *,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
    ) -> ForwardBatch:
        """The static decode batch CUDA graphs read, every row padding: token 0 at position 0,
        written to the padding KV slot 0, reading the padding request row, length 1. Its
        tensors are the graphs' fixed input buffers; ``graph_view`` slices one bucket."""
        dev = req_to_token_pool.req_to_token.device
        bs = max_batch_size
        return cls(
            mode=ForwardMode.DECODE,
            input_ids=torch.zeros(bs, dtype=torch.int64, device=dev),
            positions=torch.zeros(bs, dtype=torch.int64, device=dev),
            out_kv_slots=torch.zeros(bs, dtype=torch.int64, device=dev),
            req_slots=torch.full((bs,), padding_req_slot, dtype=torch.int64, device=dev),
            req_slots_cpu=[padding_req_slot] * bs,
            seq_lens=torch.ones(bs, dtype=torch.int64, device=dev),
            seq_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
        )

    def as_decode_rows(self) -> ForwardBatch:
        """This EXTEND batch as a DECODE batch of one row per new token: the token at position
        ``p`` of request ``r`` becomes a row of request slot ``r`` whose sequence is
        ``p + 1`` tokens long. Every new token's KV is written (at the same slots) before any
        attention reads, and each row reads its request's cached tokens up to and including its
        own, so the rows compute exactly the causal extend. Only worth it for short extends
        (a verify of 1 + k tokens): each row re-reads its request's prefix."""
        if self.mode.is_decode:
            return self
        dev = self.req_slots.device
        seq_rows: list[int] = []
        slot_rows: list[int] = []
        for slot, start, ext in zip(
            self.req_slots_cpu, self.prefix_lens_cpu, self.extend_lens_cpu, strict=True
        ):
            seq_rows.extend(range(start + 1, start + ext + 1))
            slot_rows.extend([slot] * ext)
        return dataclasses.replace(
            self,
            mode=ForwardMode.DECODE,
            req_slots=to_device(slot_rows, dev),
            req_slots_cpu=slot_rows,
            seq_lens=to_device(seq_rows, dev),
            seq_lens_cpu=seq_rows,
            prefix_lens_cpu=[n - 1 for n in seq_rows],
            extend_lens_cpu=[1] * len(seq_rows),
        )

    def graph_view(
        self,
        batch_size: int,
        seq_lens_cpu: list[int] | None = None,
        req_slots_cpu: list[int] | None = None,
    ) -> ForwardBatch:
        """The first ``batch_size`` rows of a static decode batch (views of the same storage),
        with host lists describing the step about to run (default: the static rows')."""
        bs = batch_size
        seq = self.seq_lens_cpu[:bs] if seq_lens_cpu is None else seq_lens_cpu
        return dataclasses.replace(
            self,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_kv_slots=self.out_kv_slots[:bs],
            req_slots=self.req_slots[:bs],
            req_slots_cpu=self.req_slots_cpu[:bs] if req_slots_cpu is None else req_slots_cpu,
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq,
            prefix_lens_cpu=[n - 1 for n in seq],
            extend_lens_cpu=[1] * bs,
        )
