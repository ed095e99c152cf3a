"""FP8 KV on the default model (CPU): greedy decoding with an fp8_e4m3 KV cache and calibrated
scales (the default ``--kv-cache-scales calibrate``) against the plain cache of the same compute
dtype, over 32 new tokens on sixteen varied prompts in float32 (the CPU default) and on the
first eight of them in bfloat16 (the reference the fp8-KV issue names: a bf16 KV cache).

e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per stored value; 2.6% RMS on SmolLM2's K
and V at any scale), so the logits move a little and a greedy run takes another token where the
plain run's top two are nearly tied; after that the continuations differ by construction. What
is asserted: every divergence is such a near tie (the fp8 run's token is among the plain run's
top 20 there, within ``NEAR_TIE_NATS`` of its best), at least ``MIN_FULL_AGREEMENT`` prompts
agree on all 32 tokens, and no KV slot leaks. The per-prompt agreement (tokens before the first
divergence) is printed.

Measured on SmolLM2-135M (2 CPU cores), tokens agreeing before the first divergence:

- float32, calibrated: [32, 13, 32, 32, 3, 23, 11, 32, 2, 0, 32, 3, 2, 14, 32, 7] (6 of 16 fully,
  mean 16.9), divergences at plain log-prob gaps <= 0.47 nats; with unit scales (1.0, the old
  behaviour): [32, 13, 32, 32, 3, 9, 11, 8, 4, 0, 32, 3, 3, 32, 17, 7] (5 of 16, mean 14.9).
- bfloat16, calibrated: [19, 13, 22, 32, 32, 24, 11, 8, 4, 4, 32, 3, 2, 32, 5, 15] (4 of 16,
  mean 16.1), gaps <= 1.0 nats (bf16 logits are coarse: several gaps are exact ties, 0.0); unit
  scales: 4 of 16, mean 15.4. About 20 s for both dtypes.

So "at least 32 tokens on most prompts" is out of reach for e4m3 KV on this model with any
static scales: the divergences come from the mantissa, not the range (teacher-forced over 16
prompts + 128 tokens, KL(plain || fp8) is 5.8e-3 with unit scales and 6.0e-3 calibrated), and
bf16 compute alone (plain fp32 vs plain bf16) agrees fully on only 8 of these 16 prompts.
Calibration matters for range: models whose |K| or |V| exceed 448 (unit scales saturate them)
or sit far below 2^-6. Centring before quantising does not help either (measured 2026-12-04,
float32, calibrated scales, per-layer, per-head, per-channel means from the calibration text):
storing K - mean(K) (exact for softmax: the shift q.mean is the same for every key) gave 5 of
16 prompts in full agreement (mean 16.1), V - mean(V) with the mean added back to the attention
output 6 of 16 (18.9), both 4 of 16 (16.0), against 6 of 16 (16.9) without: SmolLM2's K and V
means are not what the e4m3 rounding hurts.

Rotating before quantising helps some but not enough (measured 2026-12-05, transformers on the
same weights, fp32, e4m3 fake-quantised with power-of-two scales, teacher-forced over the sixteen
prompts + 96 greedy tokens, 1,263 positions): KL(plain || fp8) 6.3e-3 for K and V, 5.4e-3 for K
alone, 7.3e-4 for V alone (K's error dominates); a 64 x 64 Hadamard rotation of q and k after
RoPE and of v (undone on the attention output) gives 4.1e-3 (K alone 3.2e-3, -41%), a random
orthogonal one 4.4e-3. In the engine that rotation made 8 of 16 prompts agree on all 32 tokens in
float32 (mean 22.0) and 8 of 16 in bfloat16 (mean 19.9): half, still not most, so it is not
built (it would also take the fused RoPE + KV-write kernel off the fp8 path).
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
    "The main causes of the French Revolution were",
    "Translate to French: Good morning, how are you?\nFrench:",
    "SELECT name, COUNT(*) FROM orders",
    "My favourite recipe for pancakes needs",
    '{"name": "Alice", "age":',
    "In machine learning, overfitting means",
    "Dear hiring manager,\n\nI am writing to",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 32
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
TOP_LOGPROBS = 20  # bf16 logits tie often: the fp8 token may be tied with the 6th best
# per compute dtype: the plain log-prob gap allowed at a divergence (measured 0.47 and 1.0
# nats) and the fewest prompts that must agree on all 32 tokens (measured 6 and 4)
NEAR_TIE_NATS = {"float32": 0.75, "bfloat16": 1.5}
MIN_FULL_AGREEMENT = {"float32": 4, "bfloat16": 1}
# bf16 matmuls are slow on CPUs without native bf16 (about 2.5x fp32 here): the bf16 run takes
# the first eight prompts (measured 2 of 8 in full agreement in both runs above)
PROMPTS_FOR = {"float32": PROMPTS, "bfloat16": PROMPTS[:8]}


def _agreement(a: list[int], b: list[int]) -> int:
    """Tokens before the first position where ``a`` and ``b`` differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _tie_gap(top: list[list], token: int) -> float:
    """Log-prob of the plain run's best token minus that of ``token`` (inf: not in its top)."""
    lp = {int(entry[1]): entry[0] for entry in top}
    return top[0][0] - lp[token] if token in lp else float("inf")


def _engine(dtype: str, **options) -> Engine:
    return Engine(device="cpu", dtype=dtype, max_total_tokens=8192, log_level="warning", **options)


def _plain_outputs(smol_engine: Engine, dtype: str) -> list[dict]:
    """The plain cache's greedy outputs with their top log-probs (the session's engine when it
    is the one asked for)."""
    info = smol_engine.get_server_info()
    own = None if (info["device"], info["dtype"]) == ("cpu", dtype) else _engine(dtype)
    try:
        return (own or smol_engine).generate(
            PROMPTS_FOR[dtype], GREEDY, return_logprob=True, top_logprobs_num=TOP_LOGPROBS
        )
    finally:
        if own is not None:
            own.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_calibrated_fp8_e4m3_kv_greedy_agrees_with_plain_kv(smol_engine, dtype):
    start = time.perf_counter()
    plain = _plain_outputs(smol_engine, dtype)
    engine = _engine(dtype, kv_cache_dtype="fp8_e4m3")  # kv_cache_scales: calibrate
    try:
        info = engine.get_server_info()
        assert info["kv_dtype"] == "float8_e4m3fn"
        assert info["kv_scales"]["v"] != [1.0] * len(info["kv_scales"]["v"])  # calibrated
        fp8 = [o["output_ids"] for o in engine.generate(PROMPTS_FOR[dtype], GREEDY)]
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
    full = sum(a == NEW_TOKENS for a in agreement)
    print(f"\n{dtype}: calibrated fp8_e4m3 vs plain KV, tokens before the first divergence:")
    print(
        f"{agreement} ({full}/{len(agreement)} fully, mean {sum(agreement) / len(agreement):.1f})"
    )
    print(
        f"plain log-prob gaps at the divergences: {[round(g, 3) for g in gaps]} ({seconds:.1f} s)"
    )
    assert all(len(ids) == NEW_TOKENS for ids in fp8)
    assert all(g <= NEAR_TIE_NATS[dtype] for g in gaps), gaps
    assert full >= MIN_FULL_AGREEMENT[dtype], agreement
