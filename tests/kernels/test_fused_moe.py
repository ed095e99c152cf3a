"""The fused MoE kernels (Triton; interpreted without CUDA) against the torch reference of
``kernels/moe.py`` on fresh random inputs: uneven expert loads, an expert with no tokens,
choices held by another rank; bfloat16 on the GPU at several token counts, through both the
small-batch (GEMV) kernels and the grouped GEMM. The fused routing kernel against
``models/moe.route``. On the GPU a sparse block captured in a CUDA graph equals the same block
run eagerly (no host sync: sync debug mode "error") and the dense reference."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is first wrapped

from radixlm.kernels import fused_moe  # noqa: E402
from radixlm.kernels.fused_moe import align_by_expert, fused_experts, route_topk  # noqa: E402
from radixlm.kernels.moe import dense_experts_reference, grouped_experts  # noqa: E402
from radixlm.srt.distributed import TPGroup  # noqa: E402
from radixlm.srt.models.moe import MoEConfig, SparseMoeBlock, route  # noqa: E402

# expert 0 takes most tokens, expert 5 none
SKEW = [8.0, 2, 1, 1, 1, 0, 1, 1]


def _case(tokens, hidden, inter, experts, top_k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    probs = torch.tensor((SKEW * experts)[:experts])
    ids = torch.stack([torch.multinomial(probs, top_k, generator=g) for _ in range(tokens)]).view(
        tokens, top_k
    )
    weights = torch.rand(tokens, top_k, generator=g)
    to = dict(device=device)
    return (
        x.to(dtype=dtype, **to),
        gate_up.to(dtype=dtype, **to),
        down.to(dtype=dtype, **to),
        ids.to(**to),
        weights.to(**to),
    )


def test_align_groups_choices_by_expert_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [-1, 2]])
    sorted_choices, block_expert = align_by_expert(ids, num_experts=4, block_m=4)
    blocks = sorted_choices.view(-1, 4).tolist()
    sentinel = ids.numel()
    assert block_expert.tolist()[:3] == [0, 2, 3]
    assert blocks[0] == [1, sentinel, sentinel, sentinel]  # expert 0: choice 1
    assert blocks[1] == [0, 2, 5, sentinel]  # expert 2: choices 0, 2, 5 in order
    assert blocks[2] == [3, sentinel, sentinel, sentinel]
    assert all(e == -1 for e in block_expert.tolist()[3:])  # unused tail; -1 choice dropped
    assert 4 not in sorted_choices.tolist()


@pytest.mark.slow  # about 15 s under the interpreter
def test_fused_equals_torch_reference_interpreted():
    """fp32 (the interpreter's tl.dot is wrong in bf16), two token counts."""
    for tokens in (5, 40):
        x, gate_up, down, ids, weights = _case(tokens, 32, 32, 8, 2, torch.float32, "cpu")
        ids[1, 1] = -1  # held by another rank
        got = fused_experts(x, gate_up, down, ids, weights)
        want = grouped_experts(x, gate_up, down, ids, weights)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# every token count is one more tile bucket, so more Triton compiles: few of them
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [7, 333])  # small-batch kernels, grouped GEMM (uneven tail)
def test_fused_equals_torch_reference_bf16(tokens):
    x, gate_up, down, ids, weights = _case(tokens, 256, 192, 16, 4, torch.bfloat16, "cuda")
    ids[::7, -1] = -1
    got = fused_experts(x, gate_up, down, ids, weights)
    want = grouped_experts(x.float(), gate_up.float(), down.float(), ids, weights)
    assert not (ids == 5).any()  # an expert with no tokens
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.slow  # 0.5-3 s under the interpreter
def test_small_batch_kernels_equal_torch_reference_interpreted():
    """The GEMV-style path (token counts up to SMALL_BATCH_TOKENS), fp32, a choice held by
    another rank."""
    x, gate_up, down, ids, weights = _case(3, 16, 24, 8, 2, torch.float32, "cpu", seed=3)
    ids[1, 0] = -1
    assert x.shape[0] <= fused_moe.SMALL_BATCH_TOKENS
    wide = fused_moe.TileConfig(small_n=16, small_k=16, small_down_n=16, small_down_k=16)
    got = fused_experts(x, gate_up, down, ids, weights, tiles=wide)  # few interpreted programs
    want = dense_experts_reference(x, gate_up, down, ids, weights)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("sigmoid", False)])
def test_route_kernel_equals_route_and_counts_real_rows(scoring, renormalize):
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    counts = torch.full((8,), 5, dtype=torch.int64)
    counted = torch.tensor([1, 1, 0, 1, 1, 1])  # row 2 is padding
    weights, ids = route_topk(logits, 3, scoring, renormalize, counts, counted)
    want_w, want_ids = route(logits, 3, scoring, renormalize)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int64
    torch.testing.assert_close(weights, want_w)
    real = want_ids[counted.bool()].reshape(-1)
    assert counts.tolist() == (5 + torch.bincount(real, minlength=8)).tolist()


def test_tile_table_entry_overrides_the_heuristic(monkeypatch):
    key = (8, 48, 16, 2, "torch.float32", 4)
    assert fused_moe.batch_bucket(3) == 4 and fused_moe.batch_bucket(1) == 1
    assert fused_moe.tile_config(*key) == fused_moe.heuristic_tiles(4, 2, 8, 16, 24)
    mine = fused_moe.TileConfig(block_m=32, small_n=32)
    monkeypatch.setitem(fused_moe.TILE_TABLE, key[:-1] + (8,), mine)
    assert fused_moe.tile_config(*key[:-1], 8) == mine


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5])
def test_small_batch_kernels_equal_torch_reference_bf16(tokens):
    assert tokens <= fused_moe.SMALL_BATCH_TOKENS
    x, gate_up, down, ids, weights = _case(tokens, 256, 192, 16, 4, torch.bfloat16, "cuda")
    ids[0, -1] = -1
    got = fused_experts(x, gate_up, down, ids, weights)
    want = grouped_experts(x.float(), gate_up.float(), down.float(), ids, weights)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_route_kernel_equals_route_on_gpu():
    logits = torch.randn(300, 128, device="cuda")
    counts = torch.zeros(128, dtype=torch.int64, device="cuda")
    weights, ids = route_topk(logits, 8, "softmax", True, counts)
    want_w, want_ids = route(logits, 8, "softmax", True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)
    assert int(counts.sum()) == 300 * 8


def _gpu_block(shared: bool) -> SparseMoeBlock:
    moe = MoEConfig(
        num_experts=16,
        top_k=4,
        intermediate_size=192,
        renormalize=True,
        shared_intermediate_size=128 if shared else 0,
        shared_expert_gate=shared,
    )
    torch.manual_seed(0)
    block = SparseMoeBlock(256, moe, TPGroup.single())
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return block.to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(  # small-batch kernels, then grouped GEMM
    "tokens,shared", [(1, True), (4, False), (64, True)]
)
@torch.inference_mode()
def test_block_in_cuda_graph_equals_eager_and_reference(tokens, shared):
    block = _gpu_block(shared)
    static_x = torch.zeros(tokens, 256, device="cuda", dtype=torch.bfloat16)
    counted = torch.ones(tokens, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(static_x, counted)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x, counted)
    block.expert_tokens.zero_()
    for seed in range(3):  # fresh inputs through the same graph
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, 256, device="cuda", generator=g).to(torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.set_sync_debug_mode("error")  # a host sync in the eager step raises
        try:
            eager = block(x, counted)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # the same kernels on the same inputs (cuBLAS may pick another algorithm in a capture)
        torch.testing.assert_close(static_out, eager, atol=1e-2, rtol=1.6e-2)
        want = _reference(block, x)
        torch.testing.assert_close(static_out.float().cpu(), want, atol=3e-2, rtol=3e-2)
    # the graph's replays and the eager runs both counted every row: 2 x 3 x tokens x top_k
    assert int(block.expert_tokens.sum()) == 2 * 3 * tokens * 4


def _reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """float32 on the CPU with the block's own choices (bf16 logits can tie exactly; which of
    two tied experts is taken is the routing test's business, not this one's)."""
    weights, ids = route_topk(torch.nn.functional.linear(x, block.gate.weight), 4, "softmax", True)
    xf = x.float().cpu()
    experts = block.experts
    out = dense_experts_reference(
        xf,
        experts.gate_up_proj.weight.float().cpu(),
        experts.down_proj.weight.float().cpu(),
        ids.cpu(),
        weights.cpu(),
    )
    if block.shared_expert is not None:
        gate, up = (xf @ block.shared_expert.gate_up_proj.weight.float().cpu().T).chunk(2, -1)
        shared = (
            torch.nn.functional.silu(gate) * up
        ) @ block.shared_expert.down_proj.weight.float().cpu().T
        out = out + torch.sigmoid(xf @ block.shared_expert_gate.weight.float().cpu().T) * shared
    return out


def test_tile_table_loads_from_a_tune_file(tmp_path, monkeypatch):
    monkeypatch.setattr(fused_moe, "TILE_TABLE", {})
    key = [16, 96, 32, 2, "torch.bfloat16", 4]
    entry = {"key": key, "tiles": {"block_m": 32, "small_n": 4, "num_stages": 2}, "ms": 0.1}
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"device": "test", "entries": [entry]}))
    assert fused_moe.load_tile_table(str(path)) == 1
    want = fused_moe.TileConfig(block_m=32, small_n=4, num_stages=2)
    assert fused_moe.tile_config(*key) == want
    path.write_text(json.dumps({"entries": [{"key": key, "tiles": {"block_q": 1}}]}))
    with pytest.raises(ValueError, match="not a tune_moe table"):
        fused_moe.load_tile_table(str(path))
    fused_moe.tile_config.cache_clear()
