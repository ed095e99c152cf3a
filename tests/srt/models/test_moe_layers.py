"""MoE layers on their own: routing by softmax or sigmoid (renormalised or not), the sparse
block (routed experts + gated shared expert) against a dense torch reference, the expert split
over ranks, the load table, and the checkpoint names the weight map gives expert tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from radixlm.srt.distributed import TPGroup
from radixlm.srt.models.mixtral import MIXTRAL_WEIGHTS
from radixlm.srt.models.moe import ExpertShard, MoEConfig, SparseMoeBlock, TopKRouter, route
from radixlm.srt.models.weight_map import LLAMA_WEIGHTS

HIDDEN, INTER, SHARED, EXPERTS, TOP_K = 16, 12, 20, 8, 2


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_keeps_the_top_k_scores(scoring, renormalize):
    logits = torch.randn(9, EXPERTS, generator=torch.Generator().manual_seed(0))
    weights, ids = route(logits, TOP_K, scoring, renormalize)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    for t in range(9):
        best = scores[t].argsort(descending=True)[:TOP_K]
        assert ids[t].tolist() == best.tolist()
        want = scores[t, best] / (scores[t, best].sum() if renormalize else 1.0)
        torch.testing.assert_close(weights[t], want)
    assert weights.dtype == torch.float32
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))


def _moe(**overrides) -> MoEConfig:
    fields = dict(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=INTER)
    return MoEConfig(**{**fields, **overrides})


def _random_block(moe: MoEConfig, tp: TPGroup | None = None) -> SparseMoeBlock:
    torch.manual_seed(0)
    block = SparseMoeBlock(HIDDEN, moe, tp or TPGroup.single())
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return block


def _dense_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the full score vector masked to the top k."""
    moe = block.moe
    logits = F.linear(x, block.gate.weight)
    scores = logits.softmax(-1) if moe.scoring == "softmax" else logits.sigmoid()
    top = scores.topk(moe.top_k, -1)
    mask = torch.zeros_like(scores).scatter(1, top.indices, 1.0)
    w = scores * mask
    if moe.renormalize:
        w = w / w.sum(-1, keepdim=True)
    gate_up, down = block.experts.gate_up_proj.weight, block.experts.down_proj.weight
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        g, u = F.linear(x, gate_up[e]).chunk(2, -1)
        out += w[:, e : e + 1] * F.linear(F.silu(g) * u, down[e])
    if block.shared_expert is not None:
        g, u = block.shared_expert.gate_up_proj(x).chunk(2, -1)
        shared = F.linear(F.silu(g) * u, block.shared_expert.down_proj.weight)
        out += torch.sigmoid(F.linear(x, block.shared_expert_gate.weight)) * shared
    return out


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"renormalize": True},
        {"scoring": "sigmoid"},
        {"scoring": "sigmoid", "renormalize": True},
        {"shared_intermediate_size": SHARED, "shared_expert_gate": True},
    ],
)
def test_block_equals_dense_reference(options):
    block = _random_block(_moe(**options))
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(block(x), _dense_reference(block, x), atol=1e-5, rtol=1e-5)


def test_load_table_counts_real_rows_only():
    block = _random_block(_moe())
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    counted = torch.tensor([1, 1, 1, 1, 0, 0])
    with torch.no_grad():
        block(x, counted)
        _, ids = block.gate(x)
    want = torch.bincount(ids[:4].reshape(-1), minlength=EXPERTS)
    assert block.expert_tokens.tolist() == want.tolist()
    assert int(block.expert_tokens.sum()) == 4 * TOP_K
    with torch.no_grad():
        block(x)  # None: every row counts
    assert int(block.expert_tokens.sum()) == (4 + 6) * TOP_K


@pytest.mark.parametrize(("size", "ep_size"), [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (3, 3)])
def test_expert_shards_cover_every_expert_and_feature_once(size, ep_size):
    cells = []
    for rank in range(size):
        s = ExpertShard.for_rank(EXPERTS, INTER, TPGroup(rank=rank, size=size, ep_size=ep_size))
        cells += [
            (e, f)
            for e in range(s.expert_start, s.expert_start + s.num_local)
            for f in range(s.inter_start, s.inter_start + s.inter_len)
        ]
    assert sorted(cells) == [(e, f) for e in range(EXPERTS) for f in range(INTER)]


def test_local_ids_mark_other_ranks_experts():
    shard = ExpertShard.for_rank(EXPERTS, INTER, TPGroup(rank=1, size=2, ep_size=2))
    assert (shard.expert_start, shard.num_local) == (4, 4)
    ids = torch.tensor([[0, 4], [7, 3]])
    assert shard.local_ids(ids).tolist() == [[-1, 0], [3, -1]]


def test_impossible_expert_splits_are_refused():
    with pytest.raises(ValueError, match="ep_size"):
        ExpertShard.for_rank(EXPERTS, INTER, TPGroup(rank=0, size=4, ep_size=3))
    with pytest.raises(ValueError, match="exceeds the model's 2 experts"):
        ExpertShard.for_rank(2, INTER, TPGroup(rank=0, size=4, ep_size=4))


def test_sparse_layers_follow_step_and_mlp_only_layers():
    moe = _moe(decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    with pytest.raises(ValueError, match="scoring_func 'noaux_tc'"):
        _moe(scoring="noaux_tc")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _moe(top_k=9)


def test_weight_map_stacks_experts_and_keeps_suffixes():
    name = "model.layers.3.mlp.experts.17.gate_proj.weight"
    assert LLAMA_WEIGHTS.param_name(name) == (
        "model.layers.3.mlp.experts.gate_up_proj.weight",
        ("gate", 17),
    )
    assert LLAMA_WEIGHTS.param_name("model.layers.0.mlp.experts.2.down_proj.weight_scale") == (
        "model.layers.0.mlp.experts.down_proj.weight_scale",
        ("down", 2),
    )
    assert LLAMA_WEIGHTS.param_name("model.layers.0.mlp.shared_expert.up_proj.weight") == (
        "model.layers.0.mlp.shared_expert.gate_up_proj.weight",
        1,
    )
    assert LLAMA_WEIGHTS.param_name("model.layers.0.mlp.gate.weight") == (
        "model.layers.0.mlp.gate.weight",
        None,
    )
    assert MIXTRAL_WEIGHTS.param_name("model.layers.1.block_sparse_moe.experts.5.w3.weight") == (
        "model.layers.1.mlp.experts.gate_up_proj.weight",
        ("up", 5),
    )
    assert MIXTRAL_WEIGHTS.param_name("model.layers.1.block_sparse_moe.gate.weight") == (
        "model.layers.1.mlp.gate.weight",
        None,
    )


@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_routing_equals_deepseek_v3_router(renormalize):
    """n_group / topk_group with a score-correction bias and a scaling factor: the experts and
    weights of transformers' DeepSeek-V3 router (which returns them unsorted)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=renormalize,
        routed_scaling_factor=2.5,
    )
    torch.manual_seed(0)
    ref = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        ref.weight.normal_()
        ref.e_score_correction_bias.normal_(std=0.3)  # big enough to change some choices
    moe = MoEConfig.from_hf(
        config, intermediate_key="moe_intermediate_size", renormalize=renormalize
    )
    moe = dataclasses.replace(moe, scoring="sigmoid", score_correction_bias=True)
    assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (4, 2, 2.5)
    ours = TopKRouter(HIDDEN, moe)
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
        ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(32, HIDDEN)
    weights, ids = ours(x)
    _, ref_weights, ref_ids = ref(x)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))
    # the bias changed some choices: plain top-k of the scores would differ somewhere
    plain_weights, plain_ids = route(F.linear(x, ours.weight), 4, "sigmoid", renormalize)
    assert not torch.equal(plain_ids.sort(-1).values, ids.sort(-1).values)
    groups = ids // 4  # every choice in at most topk_group groups
    assert all(len(set(row)) <= 2 for row in groups.tolist())


def test_grouped_routing_options_are_checked():
    with pytest.raises(ValueError, match="n_group"):
        _moe(n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        _moe(n_group=4, topk_group=5)
