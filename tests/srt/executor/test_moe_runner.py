"""Mixture-of-Experts models through the real scheduler and model runner (CPU): greedy ids equal
transformers' over 32 steps for every MoE family, through chunked prefill (16-token chunks), a
shared prefix, a late request served from the radix cache, and batched decode; expert
parallelism on two real ranks (gloo) gives TP=1's logits and ids; the expert-load table adds up
to the routed tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import tp_harness

# the tiny checkpoints of the model tests (tests/ has no packages)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import MOE_CHECKPOINTS, VOCAB, hf_config, random_hf_model  # noqa: E402

NUM_TOKENS = 32
# float32 on a CPU: two ranks add partial sums in another order (rounding only)
LOGIT_TOL = 1e-4


def _write(name: str, folder, tokenizer):
    config = hf_config(name, vocab_size=len(tokenizer), max_position_embeddings=512)
    random_hf_model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@torch.no_grad()
def _hf_greedy(folder, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    ids = list(prompt)
    for _ in range(NUM_TOKENS):  # whole-sequence forwards: no cache of transformers' involved
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_greedy_ids_equal_transformers(name, tmp_path, tokenizer):
    from radixlm.srt.executor.model_runner import ModelRunner
    from radixlm.srt.scheduler import Scheduler
    from radixlm.srt.server.http.metrics import ServerMetrics

    folder = _write(name, tmp_path, tokenizer)
    cfg = tp_harness.make_config(folder, 1, 0)
    scheduler = Scheduler(cfg, ModelRunner(cfg))
    outputs, _, _ = tp_harness.run_workload(scheduler, num_tokens=NUM_TOKENS)
    prompts = [*tp_harness.PROMPTS, tp_harness.LATE_PROMPT]
    assert scheduler.stats.totals["num_cached_tokens"] >= len(tp_harness.PREFIX)
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == _hf_greedy(folder, prompt), f"prompt {i}"
    load = scheduler.server_info()["expert_load"]
    assert load["num_experts"] == 8 and load["top_k"] == 2 and load["ep_size"] == 1
    totals = scheduler.stats.totals  # computed tokens: prompts less their cached prefixes
    routed = totals["num_prompt_tokens"] - totals["num_cached_tokens"]
    routed += len(prompts) * (NUM_TOKENS - 1)  # decode steps (the first token is the prefill's)
    assert all(sum(row) == routed * load["top_k"] for row in load["tokens_per_expert"])
    assert all(imbalance >= 1.0 for imbalance in load["imbalance"])
    metrics = ServerMetrics("tiny")
    metrics.update_scheduler(scheduler.server_info())
    text = metrics.render().decode()
    layer, row = load["layers"][-1], load["tokens_per_expert"][-1]
    line = f'radixlm_moe_expert_tokens{{expert="7",layer="{layer}",model_name="tiny"}}'
    assert f"{line} {float(row[7])}" in text
    assert f'radixlm_moe_expert_imbalance{{layer="{layer}",model_name="tiny"}}' in text


EP_CASES = [
    ("qwen2_moe_shared", 2),
    ("olmoe_clip_qkv", 2),
    ("qwen3_moe_mixed", 1),
    ("gpt_oss", 1),  # heads (and their sinks) and every expert's features split
]


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory, tokenizer):
    """Every case through one launch of two ranks (one model runner per case on the same process
    group): the ranks' results by case."""
    jobs = []
    for name, ep_size in EP_CASES:
        folder = _write(name, tmp_path_factory.mktemp(name) / "model", tokenizer)
        jobs.append((folder, {"ep_size": ep_size}))
    out = tmp_path_factory.mktemp("ranks")
    return dict(zip(EP_CASES, tp_harness.run_jobs(jobs, out, tp_size=2), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "ep_size"), EP_CASES)
def test_expert_parallel_equals_one_rank(name, ep_size, ep_results):
    """ep_size 2: each rank holds 4 whole experts; ep_size 1: each rank holds half of every
    expert's features. Either way one all-reduce per block; the result is TP=1's."""
    results = ep_results[(name, ep_size)]
    for r in results:
        assert "error" not in r, r["error"]
        assert r["exitcode"] == 0, r
    shards = [r["expert_shard"] for r in results]
    if ep_size == 2:  # whole experts: 0-3 on rank 0, 4-7 on rank 1
        assert [(s.expert_start, s.num_local, s.inter_len) for s in shards] == [
            (0, 4, 32),
            (4, 4, 32),
        ]
    else:  # every expert on both ranks, half its features each
        assert [(s.num_local, s.inter_start, s.inter_len) for s in shards] == [
            (8, 0, 16),
            (8, 16, 16),
        ]
    (outputs, steps, _), (ref_outputs, ref_steps, _) = results[0]["tp"], results[0]["ref"]
    assert len(steps) == len(ref_steps)
    for i, (got, ref) in enumerate(zip(steps, ref_steps, strict=True)):
        assert got.shape == ref.shape, i
        if got.numel():
            assert (got - ref).abs().max().item() < LOGIT_TOL, (i, (got - ref).abs().max())
    assert outputs == ref_outputs
    assert len({tuple(ids) for ids in outputs.values()}) > 1


# GPU: ids below the tiny vocabulary (a word-level tokenizer, no downloaded model); the first
# three share a prefix and decode in a CUDA graph (batch 3 padded to the graph of 4), the five of
# the second call decode eagerly (more rows than the largest graph)
GPU_PROMPTS = [[t % VOCAB for t in p] for p in (*tp_harness.PROMPTS, tp_harness.LATE_PROMPT)]
GPU_EAGER_PROMPTS = [[(7 * t + i) % VOCAB for t in tp_harness.PREFIX] for i in range(5)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2_moe_shared", "qwen3_moe_mixed"])
def test_cuda_graph_decode_equals_eager_and_transformers(name, tmp_path):
    """MoE decode captured in CUDA graphs (the small-batch expert kernels) and run eagerly, in
    one Engine, gives transformers' ids (float32: IEEE dots in the kernels); the graphs'
    padding rows stay out of the expert-load table."""
    from radixlm.srt import Engine
    from radixlm.srt.bench.bench_gpu import write_word_tokenizer

    random_hf_model(hf_config(name, max_position_embeddings=512)).save_pretrained(tmp_path)
    write_word_tokenizer(tmp_path, VOCAB)
    greedy = {"temperature": 0, "max_new_tokens": NUM_TOKENS, "ignore_eos": True}
    with Engine(
        str(tmp_path),
        device="cuda",
        attention_backend="triton",
        dtype="float32",
        disable_overlap_schedule=True,  # no step past a request's last token
        cuda_graph_max_bs=4,
        max_total_tokens=2048,
        log_level="warning",
    ) as engine:
        assert engine.scheduler.runner.graph_runner is not None
        graphed = engine.generate(input_ids=GPU_PROMPTS, sampling_params=greedy)
        eager = engine.generate(input_ids=GPU_EAGER_PROMPTS, sampling_params=greedy)
        load = engine.get_server_info()["expert_load"]
        totals = engine.scheduler.stats.totals
    prompts = GPU_PROMPTS + GPU_EAGER_PROMPTS
    assert [o["output_ids"] for o in graphed + eager] == [_hf_greedy(tmp_path, p) for p in prompts]
    computed = totals["num_prompt_tokens"] - totals["num_cached_tokens"]
    computed += len(prompts) * (NUM_TOKENS - 1)  # decode steps (the first token is the prefill's)
    assert all(sum(row) == computed * load["top_k"] for row in load["tokens_per_expert"])
