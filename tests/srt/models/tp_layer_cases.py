"""Tensor-parallel layer cases run on real ranks (spawned processes, gloo): each rank builds its
shard of every layer from the same full weights, runs it, and compares with the single-rank
layer (``TPGroup.single()``) in the same process. Errors go back through a ``torch.save`` file."""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HIDDEN, TOKENS, HEAD_DIM = 8, 5, 4
NUM_HEADS, NUM_KV_HEADS = 9, 3  # SmolLM2's shape: 3 KV heads do not split evenly over 2 ranks
VOCAB = 11  # odd: the last rank's slice is one row short (padding)


def _full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "gate": rand(9, HIDDEN),
        "up": rand(9, HIDDEN),
        "gate_bias": rand(9),
        "up_bias": rand(9),
        "q": rand(NUM_HEADS * HEAD_DIM, HIDDEN),
        "k": rand(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        "v": rand(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        "down": rand(HIDDEN, 9),
        "down_bias": rand(HIDDEN),
        "embed": rand(VOCAB, HIDDEN),
        "x": rand(TOKENS, HIDDEN),
        "x9": rand(TOKENS, 9),
    }


def _load(layer: Any, name: str, tensor: Any, *shard: Any) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, *shard)


def _build(tp: Any, w: dict[str, Any]) -> dict[str, Any]:
    """Every layer kind, sharded for ``tp``, loaded from ``w`` (tensors or lazy slices)."""
    from radixlm.srt.models.tp_layers import (
        ColumnParallelLinear,
        HeadShard,
        ParallelLMHead,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    gate_up = ColumnParallelLinear.even(HIDDEN, [9, 9], tp, bias=True)
    for shard, part in enumerate(("gate", "up")):
        _load(gate_up, "weight", w[part], shard)
        _load(gate_up, "bias", w[f"{part}_bias"], shard)
    heads = HeadShard.for_rank(NUM_HEADS, NUM_KV_HEADS, tp.size, tp.rank)
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, heads, bias=False)
    for part in ("q", "k", "v"):
        _load(qkv, "weight", w[part], part)
    down = RowParallelLinear.even(9, HIDDEN, tp, bias=True)
    _load(down, "weight", w["down"])
    _load(down, "bias", w["down_bias"])
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
    _load(embed, "weight", w["embed"])
    head = ParallelLMHead(VOCAB, HIDDEN, tp)
    head.tie_to(embed)
    return {
        "gate_up": gate_up,
        "qkv": qkv,
        "heads": heads,
        "down": down,
        "embed": embed,
        "head": head,
    }


@torch.inference_mode()
def _compare(tp: Any, w: dict[str, torch.Tensor], lazy: dict[str, Any]) -> dict[str, float]:
    """Max |TP - single| per layer output (0.0 where bit-identical)."""
    from radixlm.srt.distributed import TPGroup
    from radixlm.srt.models.tp_layers import split_range

    one, mine = _build(TPGroup.single(), w), _build(tp, lazy)
    x, ids = w["x"], torch.tensor([0, 3, 5, 6, 10, 7, 1])
    errors: dict[str, float] = {}
    start, n = split_range(9, tp.size, tp.rank)
    ref = one["gate_up"](x)
    expected = torch.cat([ref[:, start : start + n], ref[:, 9 + start : 9 + start + n]], 1)
    errors["column"] = (mine["gate_up"](x) - expected).abs().max().item()
    h = mine["heads"]
    ref_q, ref_k, ref_v = one["qkv"].split(one["qkv"](x))
    q, k, v = mine["qkv"].split(mine["qkv"](x))
    d = HEAD_DIM
    errors["qkv"] = max(
        (q - ref_q[:, h.q_start * d : h.q_end * d]).abs().max().item(),
        (k - ref_k[:, h.kv_start * d : h.kv_end * d]).abs().max().item(),
        (v - ref_v[:, h.kv_start * d : h.kv_end * d]).abs().max().item(),
    )
    x9 = w["x9"]
    errors["row"] = (mine["down"](x9[:, start : start + n]) - one["down"](x9)).abs().max().item()
    errors["embedding"] = (mine["embed"](ids) - one["embed"](ids)).abs().max().item()
    hidden = one["embed"](ids)
    logits = mine["head"](hidden)
    assert logits.shape == (len(ids), VOCAB), logits.shape
    errors["lm_head"] = (logits - one["head"](hidden)).abs().max().item()
    return errors


def rank_main(rank: int, port: int, out_dir: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from radixlm.srt.distributed import TPGroup

    result: dict[str, Any] = {}
    try:
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank, timeout=timeout
        )
        tp = TPGroup(rank, 2, rank, dist.group.WORLD, dist.group.WORLD, dist.group.WORLD)
        w = _full_weights()
        path = Path(out_dir) / f"weights{rank}.safetensors"
        save_file(w, str(path))
        with safe_open(str(path), framework="pt") as f:  # the loaders read only their slices
            lazy = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
            result["lazy"] = _compare(tp, w, lazy)
        result["eager"] = _compare(tp, w, w)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()  # nobody leaves while a peer still talks to it
    # no destroy_process_group and no interpreter teardown: gloo's threads, torn down while the
    # peer closes its side, sometimes abort the process ("terminate called without an active
    # exception") after the results are already written
    os._exit(0)
