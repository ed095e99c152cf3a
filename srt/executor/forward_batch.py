"""The tensors one forward pass needs, built by the model runner from a scheduled batch."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixlm.kernels.attention.base import AttentionBackend
    from radixlm.srt.executor.memory_pool import KVPool, ReqToTokenPool


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
    attn_backend: AttentionBackend

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
