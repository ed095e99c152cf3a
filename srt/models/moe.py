"""Mixture-of-Experts layers: the top-k router, this rank's stack of experts, the sparse block.

**Routing** (:class:`TopKRouter`): ``logits = x W_r^T`` (``W_r`` ``[experts, hidden]``, on every
rank), scored by softmax (Qwen, Mixtral, OLMoE) or sigmoid (``scoring_func: sigmoid``), the
``top_k`` best kept; ``renormalize`` divides them by their sum (Mixtral always; Qwen and OLMoE
when ``norm_topk_prob``). Weights are float32. DeepSeek-style grouped routing (``n_group``,
``topk_group``, a score-correction bias, ``routed_scaling_factor``) is in :func:`route`.

**Parallelism** (:class:`ExpertShard`). The ``tp.size`` ranks are ``ep_size`` groups of
``tp.size // ep_size``: rank r holds the experts of group ``r // (size // ep_size)`` (a contiguous
range, whole) and, of each, the slice ``r % (size // ep_size)`` of the intermediate features
(``ep_size == 1``: every expert, its features split as a dense MLP's; ``ep_size == size``: whole
experts, none split). Activations are replicated on every rank (attention's output is
all-reduced), so every rank routes every token the same way and no dispatch is needed: each
rank computes its experts' (and its slice of the shared expert's) contribution for the tokens
that chose them, and **one all-reduce** per block adds the partial sums, the same collective a
dense MLP's row-parallel projection runs. On one host that costs the bytes of one all-reduce of
``[T, hidden]``, like the dense layer; an all-to-all dispatch pays off only when the
activations are not replicated (data-parallel attention), which this runtime does not do.

**Expert load.** Each block counts the tokens routed to each expert (cumulative, on the device,
rows of CUDA-graph padding left out); ``expert_load`` on the model reads the table.

**Kernels.** On CUDA routing (top-k and the load counters) is one kernel and the experts run in
the fused Triton kernels (``kernels/fused_moe.py``: GEMV-style kernels that stream only the
chosen experts for small batches; tokens sorted by expert and one grouped GEMM per projection
for larger ones; silu*mul fused). No step reads a value back to the host, so MoE decode steps
are captured in CUDA graphs as dense ones are. Elsewhere the torch path of ``kernels/moe.py``
runs (tokens grouped by expert, one matmul pair per expert that has tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import fused_moe, gemv
from radixlm.kernels.moe import grouped_experts
from radixlm.srt.distributed import TPGroup
from radixlm.srt.models.layers import copy_checked, silu_and_mul
from radixlm.srt.models.tp_layers import ColumnParallelLinear, _check_shape, split_range, take

SCORING = ("softmax", "sigmoid")


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


@dataclass(frozen=True)
class MoEConfig:
    """The MoE options of a checkpoint's config (see :meth:`from_hf`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    scoring: str = "softmax"  # "softmax" or "sigmoid"
    renormalize: bool = False  # top-k weights divided by their sum
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # sigmoid(x W_g^T) scales the shared expert (Qwen2-MoE)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not one of these (dense MLP)
    router_bias: bool = False  # the router adds a bias to its logits (gpt-oss)
    # DeepSeek-style grouped routing: experts in n_group groups, only the topk_group best
    # groups (a group's score: the sum of its two best) are eligible
    n_group: int = 1
    topk_group: int = 1
    score_correction_bias: bool = False  # added to the scores to choose, not to the weights
    routed_scaling_factor: float = 1.0  # multiplies the final weights

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"MoE scoring_func {self.scoring!r} is not supported; use {SCORING}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in [1, num_experts "
                f"({self.num_experts})]"
            )
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must divide num_experts ({self.num_experts})"
            )
        if self.n_group > 1 and not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group]")
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and (per_group < 2 or self.topk_group * per_group < self.top_k):
            raise ValueError(
                f"grouped routing needs at least 2 experts per group and topk_group x "
                f"experts per group >= num_experts_per_tok ({self.top_k})"
            )

    @property
    def plain_topk(self) -> bool:
        """Routing the fused kernel serves: no groups, no correction bias, no scaling."""
        return (
            self.n_group == 1 and not self.score_correction_bias and self.routed_scaling_factor == 1
        )

    @classmethod
    def from_hf(
        cls, hf: Any, *, intermediate_key: str, renormalize: bool | None = None
    ) -> MoEConfig:
        """From a transformers config: ``intermediate_key`` names the expert width's field;
        ``renormalize`` None reads ``norm_topk_prob``."""
        num_experts = getattr(hf, "num_experts", None) or hf.num_local_experts
        if renormalize is None:
            renormalize = bool(getattr(hf, "norm_topk_prob", False))
        return cls(
            num_experts=int(num_experts),
            top_k=int(hf.num_experts_per_tok),
            intermediate_size=int(getattr(hf, intermediate_key)),
            scoring=getattr(hf, "scoring_func", None) or "softmax",
            renormalize=renormalize,
            shared_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
            shared_expert_gate=bool(getattr(hf, "shared_expert_intermediate_size", 0)),
            decoder_sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
            n_group=int(getattr(hf, "n_group", None) or 1),
            topk_group=int(getattr(hf, "topk_group", None) or 1),
            routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", None) or 1.0),
        )

    def is_sparse(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has experts (else a dense MLP of ``intermediate_size``)."""
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )


def route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: torch.Tensor | None = None,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, experts]`` -> ``(weights [T, k] float32, expert ids [T, k] int64)``.

    Grouped routing (``n_group > 1``, DeepSeek-V3's): the scores plus ``correction_bias`` (the
    choosing scores) are cut into ``n_group`` groups, each scored by the sum of its two best;
    only the ``topk_group`` best groups' experts are eligible for the top k. The weights are the
    chosen experts' scores without the bias (renormalised if asked), times
    ``scaling_factor``."""
    logits = logits.float()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choosing = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        t, e = choosing.shape
        groups = choosing.view(t, n_group, e // n_group)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        best = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choosing = groups.masked_fill(~keep[..., None], float("-inf")).view(t, e)
    ids = torch.topk(choosing, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return weights, ids


class TopKRouter(nn.Module):
    """``weight`` ``[experts, hidden]`` (and ``bias`` ``[experts]`` where the config has one),
    the same on every rank (see the module docstring)."""

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = _param(moe.num_experts, hidden_size)
        self.bias = _param(moe.num_experts) if moe.router_bias else None
        self.e_score_correction_bias = (
            _param(moe.num_experts) if moe.score_correction_bias else None
        )

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        return route(
            logits,
            moe.top_k,
            moe.scoring,
            moe.renormalize,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            correction_bias=self.e_score_correction_bias,
            scaling_factor=moe.routed_scaling_factor,
        )

    def logits(self, x: torch.Tensor, stream: bool = False) -> torch.Tensor:
        """The router matmul; ``stream`` (a decoder layer on the weight-streaming path): the
        GEMV of ``kernels/gemv.py`` where it serves ``x`` (one pass over the weight, no cuBLAS
        split-K and its reduction)."""
        if stream and gemv.supported(x, self.weight):
            return gemv.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(self.logits(x))

    def route_and_count(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        counted: torch.Tensor | None,
        stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, and each token's choices added to ``counts`` ``[experts]``
        (weighted by ``counted`` ``[T]``, None: every row). On CUDA one fused kernel after the
        router matmul (``kernels/fused_moe.route_topk``) unless the routing is grouped, biased
        or scaled (torch ops then; no host sync either way). ``stream``: see :meth:`logits`."""
        moe = self.moe
        logits = self.logits(x, stream)
        if moe.plain_topk and fused_moe.available(x):
            return fused_moe.route_topk(
                logits, moe.top_k, moe.scoring, moe.renormalize, counts, counted
            )
        weights, ids = self.route_logits(logits)
        ones = (
            torch.ones_like(ids) if counted is None else counted[:, None].expand_as(ids)
        ).reshape(-1)
        counts.index_add_(0, ids.reshape(-1), ones.to(counts.dtype))
        return weights, ids


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts ``[expert_start, expert_start + num_local)`` and, of each, the
    intermediate features ``[inter_start, inter_start + inter_len)``."""

    num_experts: int
    expert_start: int
    num_local: int
    inter_start: int
    inter_len: int

    @classmethod
    def for_rank(cls, num_experts: int, intermediate_size: int, tp: TPGroup) -> ExpertShard:
        ep_size = tp.ep_size
        if tp.size % ep_size:
            raise ValueError(f"ep_size ({ep_size}) must divide tp_size ({tp.size})")
        if num_experts < ep_size:
            raise ValueError(f"ep_size ({ep_size}) exceeds the model's {num_experts} experts")
        inter_parts = tp.size // ep_size
        ep_rank, inter_rank = divmod(tp.rank, inter_parts)
        expert_start, num_local = split_range(num_experts, ep_size, ep_rank)
        inter_start, inter_len = split_range(intermediate_size, inter_parts, inter_rank)
        return cls(num_experts, expert_start, num_local, inter_start, inter_len)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> indices into this rank's stack, ``-1`` for other ranks' experts."""
        if self.num_local == self.num_experts:
            return ids
        local = ids - self.expert_start
        return torch.where((local >= 0) & (local < self.num_local), local, -1)


class ExpertLinear(nn.Module):
    """One projection of this rank's experts, stacked: ``weight`` ``[local experts, out, in]``.

    ``parts`` are the checkpoint projections stacked along ``out`` (``("gate", "up")`` or
    ``("down",)``), each ``out_full`` rows of which ``out_range`` is kept; of ``in_full`` input
    features ``in_range`` is kept. Shard ids are ``(part, expert)`` with the global expert index;
    another rank's expert is skipped (but counts as received, see ``shard_ids``)."""

    def __init__(
        self,
        shard: ExpertShard,
        parts: tuple[str, ...],
        out_full: int,
        out_range: tuple[int, int],
        in_full: int,
        in_range: tuple[int, int],
    ):
        super().__init__()
        self.shard, self.parts = shard, parts
        self.out_full, self.out_range, self.in_full, self.in_range = (
            out_full,
            out_range,
            in_full,
            in_range,
        )
        self.weight = _param(shard.num_local, len(parts) * out_range[1], in_range[1])
        self.weight.weight_loader = self.weight_loader
        self.weight.shard_ids = {(p, e) for p in parts for e in range(shard.num_experts)}

    def _local(self, expert: int) -> int | None:
        local = expert - self.shard.expert_start
        return local if 0 <= local < self.shard.num_local else None

    def shard_view(self, shard_id: tuple[str, int]) -> torch.Tensor:
        """The rows of checkpoint tensor ``shard_id`` in ``weight`` (this rank's experts only)."""
        part, expert = shard_id
        local = self._local(expert)
        if local is None or part not in self.parts:
            raise KeyError(f"expert {expert}'s {part} projection is not held by this rank")
        rows = self.out_range[1]
        return self.weight.data[local].narrow(0, self.parts.index(part) * rows, rows)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: tuple[str, int]) -> None:
        _check_shape(loaded, (self.out_full, self.in_full))
        if self._local(shard_id[1]) is None:
            return
        if self.out_range[1] != self.out_full:
            loaded = take(loaded, 0, *self.out_range)
        if self.in_range[1] != self.in_full:
            loaded = take(loaded, 1, *self.in_range)
        copy_checked(self.shard_view(shard_id), loaded)


class FusedExperts(nn.Module):
    """This rank's experts: ``gate_up_proj`` ``[local, 2 * inter, hidden]`` and ``down_proj``
    ``[local, hidden, inter]`` (``inter``: this rank's slice of the expert width)."""

    def __init__(self, hidden_size: int, intermediate_size: int, shard: ExpertShard):
        super().__init__()
        inter = (shard.inter_start, shard.inter_len)
        full = (0, hidden_size)
        self.shard = shard
        self.gate_up_proj = ExpertLinear(
            shard, ("gate", "up"), intermediate_size, inter, hidden_size, full
        )
        self.down_proj = ExpertLinear(shard, ("down",), hidden_size, full, intermediate_size, inter)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sum ``[T, hidden]`` (global ``topk_ids``)."""
        local_ids = self.shard.local_ids(topk_ids)
        run = fused_moe.fused_experts if fused_moe.available(x) else grouped_experts
        return run(x, self.gate_up_proj.weight, self.down_proj.weight, local_ids, topk_weights)


class SharedExpert(nn.Module):
    """A dense gated MLP every token goes through, split as a dense MLP is; ``partial`` leaves
    the row-parallel sum to the block's one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.even(hidden_size, [intermediate_size] * 2, tp)
        start, length = split_range(intermediate_size, tp.size, tp.rank)
        self.down_proj = ExpertDownSlice(intermediate_size, hidden_size, (start, length))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(self.gate_up_proj(x)), self.down_proj.weight)


class ExpertDownSlice(nn.Module):
    """``weight`` ``[hidden, in_len]``: columns ``in_range`` of a ``[hidden, in_full]``
    checkpoint tensor (the row-parallel half of a shared expert, without its all-reduce)."""

    def __init__(self, in_full: int, out_features: int, in_range: tuple[int, int]):
        super().__init__()
        self.in_full, self.in_range = in_full, in_range
        self.weight = _param(out_features, in_range[1])
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        _check_shape(loaded, (param.shape[0], self.in_full))
        copy_checked(param.data, take(loaded, 1, *self.in_range))


class SparseMoeBlock(nn.Module):
    """Router, this rank's experts, an optional shared expert with its gate; one all-reduce."""

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TPGroup):
        super().__init__()
        self.moe, self.tp = moe, tp
        self.gate = TopKRouter(hidden_size, moe)
        shard = ExpertShard.for_rank(moe.num_experts, moe.intermediate_size, tp)
        self.experts = FusedExperts(hidden_size, moe.intermediate_size, shard)
        self.shared_expert = (
            SharedExpert(hidden_size, moe.shared_intermediate_size, tp)
            if moe.shared_intermediate_size
            else None
        )
        self.shared_expert_gate = _GateVector(hidden_size) if moe.shared_expert_gate else None
        # tokens routed to each expert since start: [experts] int64, device (not a weight)
        self.register_buffer(
            "expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False
        )

    def forward(
        self, x: torch.Tensor, counted: torch.Tensor | None = None, stream: bool = False
    ) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``. ``counted`` ``[T]`` int64: 1 for the rows
        the load table counts (0: padding), None to count every row; ``stream``: the router
        matmul as a weight-streaming GEMV (:meth:`TopKRouter.logits`)."""
        weights, ids = self.gate.route_and_count(x, self.expert_tokens, counted, stream)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert.partial(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)


class _GateVector(nn.Module):
    """``x w^T`` with ``weight`` ``[1, hidden]`` (the shared expert's gate), on every rank."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = _param(1, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
