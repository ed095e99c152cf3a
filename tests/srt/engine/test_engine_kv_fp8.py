"""FP8 KV on the default model (CPU, float32 compute): greedy decoding with an fp8_e4m3 KV
cache against the plain cache over 32 new tokens on eight varied prompts.

e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per stored value), so the logits move a
little and a greedy run takes another token where the plain run's top two are nearly tied;
after that the continuations differ by construction. What is asserted: every divergence is
such a near tie (the fp8 run's token is among the plain run's top 5 there, within
``NEAR_TIE_NATS`` of its best), some prompts agree on all 32 tokens, and no KV slot leaks. The
per-prompt agreement (tokens before the first divergence) is printed. Measured on SmolLM2-135M
with static scales of 1.0: [32, 13, 22, 32, 3, 9, 4, 8] (2 of 8 fully), at gaps of 0.04-0.21
nats.
"""

from __future__ import annotations

import time

import pytest

from radixlm.srt import Engine

pytestmark = pytest.mark.slow  # the default model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\ndef normalize(x):",
    "Q: What is the largest planet in the solar system?\nA:",
]
NEW_TOKENS = 32
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
NEAR_TIE_NATS = 0.5  # plain log-prob gap allowed at a divergence (measured <= 0.21)


def _agreement(a: list[int], b: list[int]) -> int:
    """Tokens before the first position where ``a`` and ``b`` differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _tie_gap(top: list[list], token: int) -> float:
    """Log-prob of the plain run's best token minus that of ``token`` (inf: not in its top)."""
    lp = {int(entry[1]): entry[0] for entry in top}
    return top[0][0] - lp[token] if token in lp else float("inf")


def test_fp8_e4m3_kv_greedy_agrees_with_plain_kv(smol_engine):
    start = time.perf_counter()
    plain = smol_engine.generate(PROMPTS, GREEDY, return_logprob=True, top_logprobs_num=5)
    engine = Engine(max_total_tokens=8192, kv_cache_dtype="fp8_e4m3", log_level="warning")
    try:
        assert engine.get_server_info()["kv_dtype"] == "float8_e4m3fn"
        fp8 = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        assert engine.scheduler.check_idle()
    finally:
        engine.shutdown()
    agreement, gaps = [], []
    for p, f in zip(plain, fp8, strict=True):
        n = _agreement(p["output_ids"], f)
        agreement.append(n)
        if n < NEW_TOKENS:
            gaps.append(_tie_gap(p["meta_info"]["output_top_logprobs"][n], f[n]))
    seconds = time.perf_counter() - start
    print(f"\nfp8_e4m3 vs plain KV, tokens agreeing before the first divergence: {agreement}")
    print(f"plain log-prob gaps at the divergences: {[round(g, 3) for g in gaps]}")
    print(f"({sum(a == NEW_TOKENS for a in agreement)}/{len(PROMPTS)} fully; {seconds:.1f} s)")
    assert all(len(ids) == NEW_TOKENS for ids in fp8)
    assert all(g <= NEAR_TIE_NATS for g in gaps), gaps
    assert any(a == NEW_TOKENS for a in agreement), agreement
