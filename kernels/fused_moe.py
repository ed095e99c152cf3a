"""Fused Mixture-of-Experts (Triton): routing in one kernel, experts in two.

The contract is ``kernels/moe.py``'s (``fused_experts`` takes the same arguments as
``grouped_experts`` and returns the same result). Nothing here reads a value back to the host,
and every launch's grid follows the shapes alone, so a decode step is CUDA-graph capturable.

**Routing** (:func:`route_topk`): one program per token turns the router's logits into the
top-k weights and expert ids (softmax or sigmoid, renormalised or not; the same choices as
``models/moe.route``) and adds the token to the expert-load counters (atomics), in place of
the softmax/top-k/divide/index_add chain of small torch kernels.

**Small batches** (``T <= SMALL_BATCH_TOKENS``; the batch-1 decode path): no sort. The
gate/up kernel runs one program per (choice, block of expert features): it streams only the
chosen expert's gate and up rows against the token's row (GEMV, fp32 accumulators) and writes
``silu(gate) * up`` for that choice. The down kernel runs one program per (token, block of
hidden features): it walks the token's ``k`` choices, streams each chosen expert's down rows
against that choice's intermediate row, and writes the routing-weighted sum (no float32
``[T * k, hidden]`` buffer, no separate sum). Each chosen expert's weights are read once per
choice; at these sizes that is the active-weight traffic a decode step cannot avoid.

**Larger batches** (grouped GEMM):

1. **align** (torch ops): the ``T * k`` choices are sorted by expert and each expert's run is
   padded to a multiple of ``BLOCK_M``, so every block of ``BLOCK_M`` sorted rows belongs to one
   expert (``block_expert``; ``-1`` past the last used block). The padded length has a fixed
   upper bound, ``T * k + E * (BLOCK_M - 1)``, so the grid never depends on the routing.
2. **gate/up** kernel: program (row block, feature block) gathers its tokens' rows of ``x``,
   multiplies them by the block's expert's gate and up rows (two accumulators over the hidden
   dim) and writes ``silu(gate) * up`` into ``inter[sorted row]``.
3. **down** kernel: program (row block, hidden block) multiplies ``inter`` rows by the expert's
   ``down`` weight, scales each row by its choice's routing weight and writes the row of that
   choice in ``out [T * k, hidden]`` (float32); the ``k`` choices of a token are summed after.

**Tiles** come from :func:`tile_config`: a static table (``TILE_TABLE``) keyed by ``(experts, 2 *
inter, hidden, top_k, dtype, batch bucket)`` (the bucket: the token count rounded up to a power of
two), falling back to a shape heuristic; the answer is cached per key. The table starts empty:
``srt/bench/tune_moe.py`` times candidates on the card and writes entries that ``RADIXLM_MOE_TILES``
loads (the heuristic runs where there is no entry). A table, not an autotuner, so that the first
captured step compiles one kernel per shape and never times candidates inside a serving process.
Choices of another rank's experts (``-1``) get no work; their rows stay zero.
float32 inputs multiply in IEEE float32 (no TF32), so float32 models match the torch path.
Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None
    tl = None


def available(x: torch.Tensor) -> bool:
    """Whether the fused kernel serves this tensor (CUDA, with Triton installed)."""
    return triton is not None and x.is_cuda


def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    inter,
    hidden,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    TOP_K: tl.constexpr,
    NUM_CHOICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        choice = tl.load(sorted_ptr + rows)
        valid = choice < NUM_CHOICES
        token = tl.where(valid, choice // TOP_K, 0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = (k0 + ks) < hidden
            a = tl.load(
                x_ptr + token[:, None] * stride_xt + (k0 + ks)[None, :],
                mask=valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            wmask = k_ok[:, None] & col_ok[None, :]
            g = tl.load(
                w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None], mask=wmask, other=0.0
            )
            u = tl.load(
                w_base + (cols + inter)[None, :] * stride_wn + (k0 + ks)[:, None],
                mask=wmask,
                other=0.0,
            )
            acc_gate += tl.dot(a, g, input_precision=PRECISION)
            acc_up += tl.dot(a, u, input_precision=PRECISION)
        y = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & col_ok[None, :],
        )


def _down_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    weights_ptr,
    hidden,
    inter,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    NUM_CHOICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        choice = tl.load(sorted_ptr + rows)
        valid = choice < NUM_CHOICES
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = (k0 + ks) < inter
            a = tl.load(
                a_ptr + rows.to(tl.int64)[:, None] * stride_at + (k0 + ks)[None, :],
                mask=valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            acc += tl.dot(a, w, input_precision=PRECISION)
        scale = tl.load(weights_ptr + tl.where(valid, choice, 0), mask=valid, other=0.0)
        acc = acc * scale[:, None]
        dst = tl.where(valid, choice, 0).to(tl.int64)
        tl.store(
            out_ptr + dst[:, None] * stride_ot + cols[None, :],
            acc,
            mask=valid[:, None] & col_ok[None, :],
        )


def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    counts_ptr,
    counted_ptr,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    TOP_K_POW2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    COUNT: tl.constexpr,
    HAS_COUNTED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    logits = tl.load(logits_ptr + t * stride_l + e, mask=e_ok, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        logits = tl.where(e_ok, logits, float("-inf"))
        p = tl.exp(logits - tl.max(logits, 0))
        p = tl.where(e_ok, p, 0.0)
        scores = p / tl.sum(p, 0)
    scores = tl.where(e_ok, scores, -1.0)  # scores are >= 0: padding is never picked
    j = tl.arange(0, TOP_K_POW2)
    picked_w = tl.zeros((TOP_K_POW2,), dtype=tl.float32)
    picked_id = tl.zeros((TOP_K_POW2,), dtype=tl.int64)
    for step in tl.static_range(TOP_K):
        best = tl.max(scores, 0)
        idx = tl.min(tl.where(scores == best, e, BLOCK_E), 0)  # ties: the lowest expert
        picked_w = tl.where(j == step, best, picked_w)
        picked_id = tl.where(j == step, idx.to(tl.int64), picked_id)
        scores = tl.where(e == idx, -2.0, scores)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(j < TOP_K, picked_w, 0.0), 0)
    j_ok = j < TOP_K
    tl.store(weights_ptr + t * TOP_K + j, picked_w, mask=j_ok)
    tl.store(ids_ptr + t * TOP_K + j, picked_id, mask=j_ok)
    if COUNT:
        if HAS_COUNTED:
            one = tl.load(counted_ptr + t).to(tl.int64)
        else:
            one = 1
        tl.atomic_add(counts_ptr + picked_id, tl.zeros((TOP_K_POW2,), tl.int64) + one, mask=j_ok)


def _small_gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    ids_ptr,
    inter,
    hidden,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    choice = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + choice).to(tl.int64)
    if expert >= 0:
        token = choice // TOP_K
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = (k0 + ks) < hidden
            a = tl.load(x_ptr + token * stride_xt + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            wmask = col_ok[:, None] & k_ok[None, :]
            g = tl.load(
                w_base + cols[:, None] * stride_wn + (k0 + ks)[None, :], mask=wmask, other=0.0
            )
            u = tl.load(
                w_base + (cols + inter)[:, None] * stride_wn + (k0 + ks)[None, :],
                mask=wmask,
                other=0.0,
            )
            acc_gate += g.to(tl.float32) * a[None, :]
            acc_up += u.to(tl.float32) * a[None, :]
        gate = tl.sum(acc_gate, 1)
        y = gate / (1.0 + tl.exp(-gate)) * tl.sum(acc_up, 1)
        tl.store(out_ptr + choice * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


def _small_down_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    ids_ptr,
    weights_ptr,
    hidden,
    inter,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # one flat, pipelined loop over (choice, K chunk): the loads of the next chunks (of the same
    # or the next expert) are in flight while one is summed; the routing weight scales the
    # activation chunk, so one accumulator holds the token's weighted sum
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    chunks = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for it in tl.range(0, TOP_K * chunks, num_stages=NUM_STAGES):
        choice = token * TOP_K + it // chunks
        k0 = (it % chunks) * BLOCK_K
        expert = tl.load(ids_ptr + choice).to(tl.int64)
        local = expert >= 0  # another rank's expert: every load masked off, weight 0
        k_ok = (k0 + ks) < tl.where(local, inter, 0)
        a = tl.load(a_ptr + choice * stride_at + k0 + ks, mask=k_ok, other=0.0)
        scale = tl.load(weights_ptr + choice)
        w = tl.load(
            w_ptr
            + tl.maximum(expert, 0) * stride_we
            + cols[:, None] * stride_wn
            + (k0 + ks)[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * (a.to(tl.float32) * scale)[None, :]
    total = tl.sum(acc, 1)
    tl.store(out_ptr + token * stride_ot + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


_KERNELS = {
    "gate_up": _gate_up_kernel,
    "down": _down_kernel,
    "route": _route_kernel,
    "small_gate_up": _small_gate_up_kernel,
    "small_down": _small_down_kernel,
}


@functools.cache
def _jit(name: str):
    return triton.jit(_KERNELS[name])


def _precision(dtype: torch.dtype) -> str:
    """float32 inputs multiply in IEEE float32 (Triton's default would be TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


SMALL_BATCH_TOKENS = 8
"""Token counts up to this take the small-batch (GEMV) kernels, larger ones the grouped GEMM."""


@dataclass(frozen=True)
class TileConfig:
    """Launch tiles of one shape: the grouped GEMM's ``block_m/n/k``; the small-batch kernels'
    ``small_n``/``small_k`` (gate/up) and ``small_down_n``/``small_down_k`` (down), their loops
    pipelined ``num_stages`` deep."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    small_n: int = 8
    small_k: int = 256
    small_down_n: int = 4
    small_down_k: int = 256
    num_stages: int = 3


TILE_TABLE: dict[tuple[int, int, int, int, str, int], TileConfig] = {}
"""Measured tiles per ``(experts, 2 * inter, hidden, top_k, dtype name, batch bucket)``; a
missing key falls back to :func:`heuristic_tiles`. Empty unless ``RADIXLM_MOE_TILES`` names
a file written by ``srt/bench/tune_moe.py`` (read at import, :func:`load_tile_table`)."""


def load_tile_table(path: str) -> int:
    """Adds the entries of a ``tune_moe`` JSON file to ``TILE_TABLE``; returns how many.
    ``ValueError`` naming the file for anything else."""
    try:
        entries = json.loads(Path(path).read_text())["entries"]
        table = {
            (*map(int, e["key"][:4]), str(e["key"][4]), int(e["key"][5])): TileConfig(**e["tiles"])
            for e in entries
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"RADIXLM_MOE_TILES={path}: not a tune_moe table ({e})") from e
    TILE_TABLE.update(table)
    tile_config.cache_clear()
    return len(table)


def batch_bucket(num_tokens: int) -> int:
    """The token count rounded up to a power of two (the table's batch key)."""
    return 1 << max(num_tokens - 1, 0).bit_length()


@functools.cache
def tile_config(
    num_experts: int, two_inter: int, hidden: int, top_k: int, dtype: str, bucket: int
) -> TileConfig:
    """The tiles for a shape: ``TILE_TABLE``'s entry, else the heuristic (cached per key)."""
    key = (num_experts, two_inter, hidden, top_k, dtype, bucket)
    if key in TILE_TABLE:
        return TILE_TABLE[key]
    return heuristic_tiles(bucket, top_k, num_experts, hidden, two_inter // 2)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _gemv_tile(programs_per_block_row: int, n: int, k: int, tile: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)`` as ``kernels/gemv.config`` picks them: the largest ``BLOCK_N`` of
    16, 8, 4 that leaves at least 512 programs (about four per SM of 132), a ``tile``-element
    weight tile, ``BLOCK_K`` capped by ``k``."""
    block_n = next((b for b in (16, 8) if programs_per_block_row * -(-n // b) >= 512), 4)
    block_n = min(block_n, _pow2_at_least(n))
    block_k = min(max(tile // block_n, 16), _pow2_at_least(max(k, 16)))
    return block_n, block_k


def heuristic_tiles(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int
) -> TileConfig:
    """Grouped GEMM: ``BLOCK_M`` follows the average rows an expert receives (16 for
    decode-sized batches, up to 64 for prefills); narrow shapes (tests) get 32-wide tiles.
    Small-batch kernels: gemv's rule (gate/up streams two 2,048-element tiles per step, one per
    projection; down one 4,096-element tile)."""
    rows_per_expert = max(num_tokens * top_k // num_experts, 1)
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    wide = 64 if min(hidden, inter) >= 64 else 32
    small_n, small_k = _gemv_tile(num_tokens * top_k, inter, hidden, 2048)
    down_n, down_k = _gemv_tile(num_tokens, hidden, inter, 4096)
    return TileConfig(
        block_m=block_m,
        block_n=wide,
        block_k=wide,
        small_n=small_n,
        small_k=small_k,
        small_down_n=down_n,
        small_down_k=down_k,
    )


if os.environ.get("RADIXLM_MOE_TILES"):
    load_tile_table(os.environ["RADIXLM_MOE_TILES"])


def route_topk(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    counts: torch.Tensor | None = None,
    counted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``models/moe.route`` in one launch: router logits ``[T, E]`` -> ``(weights [T, k]
    float32, ids [T, k] int64)``; with ``counts`` (``[E]`` int64) each token's choices are added
    to it, weighted by ``counted[t]`` (``[T]`` integers; None: 1 per token)."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits.contiguous()
    _jit("route")[(num_tokens,)](
        logits,
        weights,
        ids,
        counts if counts is not None else ids,
        counted if counted is not None else ids,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        TOP_K_POW2=triton.next_power_of_2(top_k),
        BLOCK_E=triton.next_power_of_2(num_experts),
        SIGMOID=scoring == "sigmoid",
        RENORMALIZE=renormalize,
        COUNT=counts is not None,
        HAS_COUNTED=counted is not None,
    )
    return weights, ids


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_choices [padded] int32, block_expert [padded / block_m] int32)``: choice indices
    (into the flattened ``[T * k]``) grouped by expert, each expert's run padded to a multiple of
    ``block_m`` with the sentinel ``T * k``; the expert of every block, ``-1`` for unused blocks.
    Torch ops only, no host sync; choices ``< 0`` (other ranks' experts) are left out."""
    flat = topk_ids.reshape(-1).long()
    num_choices = flat.numel()
    device = flat.device
    padded_len = num_choices + num_experts * (block_m - 1)
    padded_len = -(-padded_len // block_m) * block_m
    local = flat >= 0
    key = torch.where(local, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded_counts, 0) - padded_counts  # [E]
    sorted_start = torch.cumsum(counts, 0) - counts  # [E] where each expert's run starts
    sorted_key = key[order]
    in_local = sorted_key < num_experts
    e = sorted_key.clamp(max=num_experts - 1)
    position = padded_start[e] + torch.arange(num_choices, device=device) - sorted_start[e]
    position = torch.where(in_local, position, padded_len)  # dropped by the scatter below
    sorted_choices = torch.full((padded_len + 1,), num_choices, dtype=torch.int32, device=device)
    sorted_choices.scatter_(0, position, order.to(torch.int32))
    block_start = torch.arange(0, padded_len, block_m, device=device)
    padded_end = torch.cumsum(padded_counts, 0)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_choices[:padded_len], block_expert


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """``kernels/moe.grouped_experts``'s contract: the small-batch kernels for up to
    ``SMALL_BATCH_TOKENS`` tokens, else the align step and two grouped GEMM launches.
    ``tiles`` overrides :func:`tile_config`'s answer."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    if down.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"down has shape {tuple(down.shape)}, expected {(num_experts, hidden, inter)}"
        )
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    x = x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    if tiles is None:
        tiles = tile_config(
            num_experts, two_inter, hidden, top_k, str(x.dtype), batch_bucket(num_tokens)
        )
    if num_tokens <= SMALL_BATCH_TOKENS:
        return _small_batch(x, gate_up, down, topk_ids, topk_weights, tiles)
    num_choices = num_tokens * top_k
    precision = _precision(x.dtype)
    block_m, block_n, block_k = tiles.block_m, tiles.block_n, tiles.block_k
    sorted_choices, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    inter_rows = x.new_empty(sorted_choices.numel(), inter)
    _jit("gate_up")[(num_blocks, triton.cdiv(inter, block_n))](
        x,
        gate_up,
        inter_rows,
        sorted_choices,
        block_expert,
        inter,
        hidden,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        inter_rows.stride(0),
        TOP_K=top_k,
        NUM_CHOICES=num_choices,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
    )
    out = torch.zeros(num_choices, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _jit("down")[(num_blocks, triton.cdiv(hidden, block_n))](
        inter_rows,
        down,
        out,
        sorted_choices,
        block_expert,
        weights,
        hidden,
        inter,
        inter_rows.stride(0),
        down.stride(0),
        down.stride(1),
        out.stride(0),
        NUM_CHOICES=num_choices,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
    )
    return out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)


def _small_batch(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiles: TileConfig,
) -> torch.Tensor:
    """The GEMV-style kernels (see the module docstring): two launches, no sort."""
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    inter = down.shape[2]
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    inter_rows = x.new_empty(num_tokens * top_k, inter)
    _jit("small_gate_up")[(num_tokens * top_k, triton.cdiv(inter, tiles.small_n))](
        x,
        gate_up,
        inter_rows,
        ids,
        inter,
        hidden,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        inter_rows.stride(0),
        TOP_K=top_k,
        BLOCK_N=tiles.small_n,
        BLOCK_K=tiles.small_k,
        NUM_STAGES=tiles.num_stages,
    )
    out = x.new_empty(num_tokens, hidden)
    _jit("small_down")[(num_tokens, triton.cdiv(hidden, tiles.small_down_n))](
        inter_rows,
        down,
        out,
        ids,
        weights,
        hidden,
        inter,
        inter_rows.stride(0),
        down.stride(0),
        down.stride(1),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_N=tiles.small_down_n,
        BLOCK_K=tiles.small_down_k,
        NUM_STAGES=tiles.num_stages,
    )
    return out
