"""Tensor-parallel layers at TP=2 (two real processes, gloo) equal the single-rank layers, with
uneven splits (9 query heads / 3 KV heads, 9 MLP features, an odd vocabulary), loading from
full tensors and from lazy safetensors slices; the head split covers every head once."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
import tp_layer_cases

from radixlm.srt.models.tp_layers import HeadShard, split_range

# float32: column-parallel outputs, lookups and logits are the same dot products (bit-identical
# in practice); the row-parallel sum adds two partial sums, a different rounding order
EXACT_TOL, SUM_TOL = 1e-6, 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_split_range_is_contiguous_and_near_even():
    for n in range(0, 12):
        for parts in range(1, 5):
            ranges = [split_range(n, parts, i) for i in range(parts)]
            assert sum(length for _, length in ranges) == n
            assert all(a + la == b for (a, la), (b, _) in zip(ranges, ranges[1:], strict=False))
            assert max(r[1] for r in ranges) - min(r[1] for r in ranges) <= 1


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"),
    [(9, 3, 1), (9, 3, 2), (9, 3, 3), (32, 8, 3), (8, 2, 4), (8, 1, 8), (12, 2, 4), (4, 4, 4)],
)
def test_head_shards_cover_every_query_head_once_with_its_kv_head(heads, kv_heads, size):
    group = heads // kv_heads
    shards = [HeadShard.for_rank(heads, kv_heads, size, r) for r in range(size)]
    covered = [h for s in shards for h in range(s.q_start, s.q_end)]
    assert covered == list(range(heads))
    for s in shards:
        assert s.num_heads >= 1 and s.num_kv_heads >= 1
        assert s.num_heads % s.num_kv_heads == 0  # the kernels' GQA layout holds per rank
        local_group = s.num_heads // s.num_kv_heads
        for h in range(s.q_start, s.q_end):  # local kv index of a local head == its own kv head
            assert s.kv_start + (h - s.q_start) // local_group == h // group


def test_smollm2_split_is_two_kv_heads_and_one():
    assert HeadShard.for_rank(9, 3, 2, 0) == HeadShard(0, 6, 0, 2)
    assert HeadShard.for_rank(9, 3, 2, 1) == HeadShard(6, 9, 2, 3)


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(9, 3, 4), (4, 2, 8), (6, 4, 2)])
def test_impossible_head_splits_are_refused(heads, kv_heads, size):
    with pytest.raises(ValueError, match="num_kv_heads|tp_size"):
        HeadShard.for_rank(heads, kv_heads, size, 0)


@pytest.mark.slow
def test_layers_at_tp2_equal_the_single_rank_layers(tmp_path):
    mp.start_processes(
        tp_layer_cases.rank_main,
        args=(_free_port(), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert "error" not in result, result["error"]
        for how in ("eager", "lazy"):
            errors = result[how]
            assert errors["row"] < SUM_TOL, (rank, how, errors)
            for name in ("column", "qkv", "embedding", "lm_head"):
                assert errors[name] < EXACT_TOL, (rank, how, name, errors)
            assert errors["embedding"] == 0.0  # one non-zero row plus zeros: exact
