"""Tensor-parallel layers: each rank holds a slice of a weight and reads only that slice.

* :class:`ColumnParallelLinear` (and :class:`QKVParallelLinear`): the output features are split;
  rank r computes its slice of the output, no communication. Merged projections (gate + up,
  q + k + v) are split per checkpoint shard, so each rank's gate rows line up with its up rows.
* :class:`RowParallelLinear`: the input features are split (the output of a column-parallel
  layer); each rank computes a partial sum, one all-reduce adds them, the bias is added after.
* :class:`VocabParallelEmbedding`: rank r holds vocabulary rows ``[r*n, (r+1)*n)``
  (``n = ceil(vocab / size)``; the last rank's missing rows are zero padding); tokens outside
  the slice look up zeros and an all-reduce adds the one non-zero row.
* :class:`ParallelLMHead`: the same vocabulary slices (so it may share the embedding's weight);
  each rank computes its slice of the logits, an all-gather assembles ``[N, vocab]`` on every rank.

Attention heads are split along KV-head groups (:class:`HeadShard`): rank r takes a contiguous
range of KV heads and the query heads that read them, so every rank keeps the model's GQA ratio
and the attention kernels run unchanged. Uneven splits are allowed (SmolLM2's 3 KV heads over 2
ranks: 2 + 1, i.e. 6 + 3 query heads); with fewer KV heads than ranks each KV head is
replicated on ``size // num_kv_heads`` ranks that split its query heads between them.

Checkpoint tensors may arrive as lazy safetensors slices (``get_slice``): :func:`take` reads
only the requested rows or columns from the file. At ``size == 1`` every layer is the plain
layer: the slice is the whole tensor and no collective runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.srt.distributed import TPGroup
from radixlm.srt.models.layers import LMHead, MergedLinear, VocabEmbedding, copy_checked


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of part ``index`` of ``n`` items cut into ``parts`` contiguous parts
    whose lengths differ by at most one (the first ``n % parts`` parts are one longer)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """The query heads ``[q_start, q_end)`` and KV heads ``[kv_start, kv_end)`` of one rank."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start

    @classmethod
    def for_rank(cls, num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        group = num_heads // num_kv_heads  # query heads per KV head
        if num_kv_heads >= size:
            kv_start, kv_len = split_range(num_kv_heads, size, rank)
            return cls(kv_start * group, (kv_start + kv_len) * group, kv_start, kv_start + kv_len)
        if size % num_kv_heads or group < size // num_kv_heads:
            raise ValueError(
                f"tp_size {size} does not fit {num_kv_heads} KV heads of {group} query heads "
                f"each: with fewer KV heads than ranks, tp_size must be a multiple of "
                f"num_kv_heads and at most num_heads ({num_heads})"
            )
        replicas = size // num_kv_heads
        kv = rank // replicas
        q_start, q_len = split_range(group, replicas, rank % replicas)
        return cls(kv * group + q_start, kv * group + q_start + q_len, kv, kv + 1)


def shape_of(loaded: Any) -> tuple[int, ...]:
    """The full shape of a checkpoint tensor or lazy safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def take(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Items ``[start, start + length)`` along ``dim`` (0 or 1) of a checkpoint tensor; from a
    lazy safetensors slice only those bytes are read."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (slice(None),) * dim + (slice(start, start + length),)
    return loaded[index]


def _check_shape(loaded: Any, expected: Sequence[int]) -> None:
    """The full checkpoint tensor's shape (before this rank takes its slice)."""
    shape = shape_of(loaded)
    if shape != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {shape}, expected {tuple(expected)}")


class ColumnParallelLinear(MergedLinear):
    """Projections stacked along the output dim, each split across ranks.

    ``full_sizes[i]``: output features of checkpoint shard ``i``; ``ranges[i]``: ``(start,
    length)`` of the rows of that shard this rank keeps. The local weight is
    ``[sum(lengths), in_features]``: the kept rows of each shard, shard after shard.
    """

    def __init__(
        self,
        in_features: int,
        full_sizes: Sequence[int],
        ranges: Sequence[tuple[int, int]],
        bias: bool = False,
    ):
        super().__init__(in_features, [length for _, length in ranges], bias)
        self.full_sizes = list(full_sizes)
        self.ranges = list(ranges)

    @classmethod
    def even(
        cls, in_features: int, full_sizes: Sequence[int], tp: TPGroup, bias: bool = False
    ) -> ColumnParallelLinear:
        """Each shard split as evenly as possible (lengths differ by at most one)."""
        ranges = [split_range(n, tp.size, tp.rank) for n in full_sizes]
        return cls(in_features, full_sizes, ranges, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int = 0) -> None:
        _check_shape(loaded, (self.full_sizes[shard_id], *param.shape[1:]))
        start, length = self.ranges[shard_id]
        super().weight_loader(param, take(loaded, 0, start, length), shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections of this rank's heads; shard ids ``"q"``, ``"k"``, ``"v"``."""

    SHARDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_heads: int,
        total_kv_heads: int,
        heads: HeadShard,
        bias: bool,
    ):
        self.q_size, self.kv_size = heads.num_heads * head_dim, heads.num_kv_heads * head_dim
        q_range = (heads.q_start * head_dim, self.q_size)
        kv_range = (heads.kv_start * head_dim, self.kv_size)
        full_kv = total_kv_heads * head_dim
        super().__init__(
            hidden_size,
            [total_heads * head_dim, full_kv, full_kv],
            [q_range, kv_range, kv_range],
            bias,
        )

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str) -> None:  # type: ignore[override]
        super().weight_loader(param, loaded, self.SHARDS.index(shard_id))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(MergedLinear):
    """``y = all_reduce(x_r W_r^T) + b``: rank r holds input features ``[start, start + length)``
    of ``W`` (``[out_features, in_full]``); the bias is replicated and added once."""

    def __init__(
        self,
        in_full: int,
        out_features: int,
        in_range: tuple[int, int],
        tp: TPGroup,
        bias: bool = False,
    ):
        super().__init__(in_range[1], [out_features], bias)
        self.in_full, self.in_range, self.tp = in_full, in_range, tp

    @classmethod
    def even(
        cls, in_full: int, out_features: int, tp: TPGroup, bias: bool = False
    ) -> RowParallelLinear:
        return cls(in_full, out_features, split_range(in_full, tp.size, tp.rank), tp, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int = 0) -> None:
        if param is self.bias:
            copy_checked(param.data, loaded)
            return
        _check_shape(loaded, (param.shape[0], self.in_full))
        copy_checked(param.data, take(loaded, 1, *self.in_range))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """``(start, rows held, rows padded to)``: rank r's vocabulary slice; every rank pads to
    ``ceil(vocab / size)`` rows so the logits all-gather has equal parts."""
    padded = -(-vocab_size // tp.size)
    start = min(tp.rank * padded, vocab_size)
    return start, min(padded, vocab_size - start), padded


def _load_vocab_rows(param: nn.Parameter, loaded: Any, vocab: int, start: int, rows: int) -> None:
    _check_shape(loaded, (vocab, *param.shape[1:]))
    copy_checked(param.data[:rows], take(loaded, 0, start, rows))
    param.data[rows:].zero_()


class VocabParallelEmbedding(VocabEmbedding):
    """Rank r's rows of the embedding (``[padded, hidden]``); lookups all-reduced across ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        self.vocab_size, self.tp = vocab_size, tp
        self.start, self.rows, padded = vocab_range(vocab_size, tp)
        super().__init__(padded, hidden_size)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        _load_vocab_rows(param, loaded, self.vocab_size, self.start, self.rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(LMHead):
    """Rank r's vocabulary rows of the LM head; logits all-gathered to ``[N, vocab]`` on every
    rank (the same slices as :class:`VocabParallelEmbedding`, so the two may share a weight)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        self.vocab_size, self.tp = vocab_size, tp
        self.start, self.rows, padded = vocab_range(vocab_size, tp)
        super().__init__(padded, hidden_size)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        _load_vocab_rows(param, loaded, self.vocab_size, self.start, self.rows)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError("the LM head and the embedding are split differently across ranks")
        super().tie_to(embedding)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 (the full vocabulary on every rank)."""
        logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits.float()
        # gathered in the model dtype (half the bytes of float32 with bf16), then widened
        logits = self.tp.all_gather(logits, dim=-1).float()
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size].contiguous()  # samplers and masks want dense rows
