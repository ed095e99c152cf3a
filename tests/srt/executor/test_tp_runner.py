"""ModelRunner with tensor parallelism on two real processes (gloo on CPUs): rank 0 runs the
real scheduler (chunked prefill, a shared prefix, a late request that hits the prefix cache,
greedy decoding) and its logits equal TP=1's on the same schedule; followers stop cleanly, and
a follower whose rank 0 dies or stalls raises instead of hanging."""

from __future__ import annotations

import os

import pytest
import torch
import tp_harness

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.distributed import cpu_threads_per_rank
from radixlm.srt.executor.model_runner import ModelRunner

# float32 on a CPU: row-parallel layers add two partial sums instead of one, so logits differ
# from TP=1 by rounding only (measured: at most 2e-6 on these models, 3.4e-5 on SmolLM2)
LOGIT_TOL = 1e-4

VARIANTS = {
    # 3 KV heads over 2 ranks: 2 + 1 (uneven), tied embedding
    "llama-uneven-heads": dict(
        architecture="llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3
    ),
    # 1 KV head replicated on both ranks, q/k/v biases, an LM head of its own
    "qwen2-replicated-kv": dict(
        architecture="qwen2",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    ),
}
# runner options per variant: the second one pages KV in 4-token pages in a pool too small for
# the workload, so decode retracts requests (freed rows, re-prefill from the prefix cache)
RUNNER_OPTIONS = {
    "llama-uneven-heads": {},
    "qwen2-replicated-kv": {"page_size": 4, "max_total_tokens": 96},
}


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory, tiny_model_writer, default_model_dir):
    """Each variant and the default model through one launch of two ranks (one model runner per
    model on the same process group): the ranks' results by variant name (``"default"``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    jobs = []
    for name in sorted(VARIANTS):
        shape = dict(VARIANTS[name])
        path = tmp_path_factory.mktemp(name)
        # larger weights than the default init: varied greedy tokens, not one token repeated
        folder = tiny_model_writer(path, tok, initializer_range=0.2, **shape)
        jobs.append((folder, RUNNER_OPTIONS[name]))
    jobs.append((default_model_dir, {}))
    out = tmp_path_factory.mktemp("ranks")
    names = [*sorted(VARIANTS), "default"]
    return dict(zip(names, tp_harness.run_jobs(jobs, out), strict=True))


def _check_equal_to_tp1(results: list[dict], tol: float) -> None:
    for r in results:
        assert "error" not in r, r["error"]
        assert r["exitcode"] == 0, r
    (outputs, steps, retracted), (ref_outputs, ref_steps, ref_retracted) = (
        results[0]["tp"],
        results[0]["ref"],
    )
    assert retracted == ref_retracted
    assert len(steps) == len(ref_steps)
    for i, (got, ref) in enumerate(zip(steps, ref_steps, strict=True)):
        assert got.shape == ref.shape, (i, got.shape, ref.shape)
        if got.numel():
            assert (got - ref).abs().max().item() < tol, (i, (got - ref).abs().max().item())
    assert outputs == ref_outputs
    assert all(len(ids) == tp_harness.NUM_TOKENS for ids in outputs.values())
    assert len(outputs) == len(tp_harness.PROMPTS) + 1


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp2_logits_and_greedy_tokens_equal_tp1(variant, tp_runs):
    options = RUNNER_OPTIONS[variant]
    results = tp_runs[variant]
    _check_equal_to_tp1(results, LOGIT_TOL)
    assert (results[0]["tp"][2] > 0) == ("max_total_tokens" in options)  # retractions happened
    assert len({tuple(ids) for ids in results[0]["tp"][0].values()}) > 1
    # the follower ran every step and returned when rank 0 stopped it
    assert results[1]["ok"] and results[1]["followed_s"] >= 0
    # every rank agrees on the slot layout; each holds its own KV heads
    assert results[0]["max_total_tokens"] == results[1]["max_total_tokens"]
    cores = len(os.sched_getaffinity(0))
    assert [r["threads"] for r in results] == [cpu_threads_per_rank(cores, 2)] * 2


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "stall"])
def test_follower_raises_when_rank0_dies_or_stalls(tiny_llama_dir, tmp_path, how):
    """``exit``: rank 0's process ends while the follower waits for a step (its connection
    closes: the follower fails at once). ``stall``: rank 0 sends a step header and nothing else:
    the follower times out after ``dist_timeout_s`` (3 s here)."""
    result = tp_harness.run_death(tiny_llama_dir, tmp_path, how)
    assert "error" in result, result
    assert result["elapsed_s"] < 30, result
    if how == "stall":
        assert result["elapsed_s"] >= 2.5, result


def test_unsupported_options_are_refused_before_joining(tiny_llama_dir):
    base = dict(model_path=str(tiny_llama_dir), device="cpu", tp_size=2)
    base["dist_init_addr"] = "127.0.0.1:9"  # never contacted: the check comes first
    with pytest.raises(ValueError, match="enable_hierarchical_cache"):
        ModelRunner(config_from_kwargs(**base, enable_hierarchical_cache=True))
    with pytest.raises(ValueError, match="int4"):
        ModelRunner(config_from_kwargs(**base, quantization="int4"))


def test_single_rank_runner_has_no_followers(tiny_llama_dir):
    runner = ModelRunner(config_from_kwargs(model_path=str(tiny_llama_dir), device="cpu"))
    assert runner.tp.size == 1 and runner.step_sender is None
    assert runner.req_to_token_pool.journal is None  # nothing recorded without followers
    runner.stop_followers()  # a no-op
    with pytest.raises(RuntimeError, match="follow"):
        runner.follow()


@pytest.mark.slow
def test_tp2_greedy_equals_tp1_on_the_default_model(tp_runs):
    """SmolLM2-135M (9 query heads, 3 KV heads: split 6 + 3): 16 greedy tokens per prompt."""
    _check_equal_to_tp1(tp_runs["default"], 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("disable_cuda_graph", [False, True], ids=["graphs", "eager"])
def test_tp2_with_nccl_equals_tp1(default_model_dir, tmp_path, disable_cuda_graph):
    """Two GPUs, NCCL (captured in the decode CUDA graphs, or eager), the GPU's default
    scheduling: greedy tokens equal TP=1's (float32 weights, so rounding differences stay far
    below the top-2 logit gaps)."""
    results = tp_harness.run_ranks(
        default_model_dir,
        tmp_path,
        device="cuda",
        dtype="float32",
        max_total_tokens=8192,
        disable_cuda_graph=disable_cuda_graph,
    )
    _check_equal_to_tp1(results, 1e-2)
