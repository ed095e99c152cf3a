"""About 400 prompts sharing random prefixes, sent from several threads into a pool far smaller
than their tokens: every request is answered, the cache is used and evicted, nothing leaks, and
a sample of the answers equals a cache-free run."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

NUM_PROMPTS = 400
POOL = 3000
NUM_CHECKED = 24  # answers compared with a cache-free engine


def make_workload(seed: int = 0) -> tuple[list[list[int]], list[dict]]:
    """Prompts built from a random two-level prefix tree (system prompt, then a shared
    few-shot block or none, then a unique question), with random output lengths."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    systems = [ids(rng.randrange(8, 300)) for _ in range(12)]
    blocks = {i: [ids(rng.randrange(1, 80)) for _ in range(3)] + [[]] for i in range(len(systems))}
    prompts, params = [], []
    for _ in range(NUM_PROMPTS):
        i = rng.randrange(len(systems))
        prompts.append(systems[i] + rng.choice(blocks[i]) + ids(rng.randrange(1, 40)))
        params.append({"temperature": 0, "max_new_tokens": rng.randrange(1, 9), "ignore_eos": True})
    return prompts, params


def run_concurrently(engine, prompts, params, num_threads: int = 4, chunk: int = 25) -> list[dict]:
    """Sends the prompts in chunks from several threads, so arrivals mix with running steps."""
    starts = range(0, len(prompts), chunk)
    with ThreadPoolExecutor(num_threads) as pool:
        futures = [
            pool.submit(
                engine.generate,
                input_ids=prompts[s : s + chunk],
                sampling_params=params[s : s + chunk],
            )
            for s in starts
        ]
        return [out for f in futures for out in f.result(timeout=300)]


@pytest.mark.parametrize(
    "policy",
    [
        "lpm",
        pytest.param("fcfs", marks=pytest.mark.slow),
        pytest.param("dfs-weight", marks=pytest.mark.slow),
    ],
)
def test_shared_prefix_stress_under_a_small_pool(tiny_llama_dir, policy):
    from radixlm.srt import Engine

    prompts, params = make_workload()
    assert sum(len(p) for p in prompts) > 10 * POOL
    engine = Engine(
        model_path=str(tiny_llama_dir),
        max_total_tokens=POOL,
        log_level="warning",
        schedule_policy=policy,
        chunked_prefill_size=256,
    )
    cache = engine.scheduler.cache
    evicted: list[int] = []
    evict = cache.evict
    cache.evict = lambda n: evicted.append(evict(n)) or evicted[-1]  # count what eviction frees
    try:
        outs = run_concurrently(engine, prompts, params)
        info = engine.get_server_info()
        assert engine.scheduler.check_idle()
        cache.check_integrity()
    finally:
        engine.shutdown()
    assert len(outs) == NUM_PROMPTS
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": p["max_new_tokens"]}
        assert len(out["output_ids"]) == meta["completion_tokens"] == p["max_new_tokens"]
        assert meta["prompt_tokens"] == len(prompt)
        assert 0 <= meta["cached_tokens"] <= len(prompt) - 1
    assert info["num_running"] == info["num_waiting"] == 0
    assert info["available"] + info["evictable"] + info["protected"] == POOL
    assert info["protected"] == 0
    assert sum(evicted) > POOL, "the pool was meant to be too small to keep every prefix"
    hits = sum(o["meta_info"]["cached_tokens"] for o in outs)
    assert hits > sum(len(p) for p in prompts) // 2, "shared prefixes were meant to hit the cache"
    check_sample_against_cache_free_run(tiny_llama_dir, prompts, params, outs)


def check_sample_against_cache_free_run(model_dir, prompts, params, outs) -> None:
    from radixlm.srt import Engine

    picked = random.Random(1).sample(range(len(prompts)), NUM_CHECKED)
    with Engine(
        model_path=str(model_dir),
        max_total_tokens=8192,
        log_level="warning",
        disable_radix_cache=True,
    ) as ref:
        expected = ref.generate(
            input_ids=[prompts[i] for i in picked], sampling_params=[params[i] for i in picked]
        )
    assert [outs[i]["output_ids"] for i in picked] == [e["output_ids"] for e in expected]
