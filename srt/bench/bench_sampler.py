"""Sampling cost on the CPU: the CPU path (candidates + inverse CDF) against the sort + exponential
race that GPU rows use, side by side in one run.

    python -m radixlm.srt.bench.bench_sampler                     # sampler alone + default model
    python -m radixlm.srt.bench.bench_sampler --skip-engine --batch-sizes 1,16,64

Part 1 times ``Sampler.sample`` alone on real next-token logits of the default model
(SmolLM2-135M through transformers, every position of a few built-in texts; batch rows take
them in turn), for each batch size and sampling setting; it also reports the shares of
rows whose top-p cut-off fell beyond the first (256) and the last (4,096) candidate count (the
latter go through the sort). Part 2 decodes
with the default model (``--batch-size`` requests of ``--output-len`` tokens, EOS ignored) with
each setting, once with the CPU path and once with the sort + race swapped in, and prints decode
tokens per second ("ratio": CPU path over sort + race).
"""

from __future__ import annotations

import argparse
import time

import torch

from radixlm.srt.sampling import sampler as sampler_module
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.sampling.sampler import (
    Sampler,
    SamplingBatchInfo,
    exponential_race,
    filtered_probs,
)

SETTINGS = {
    "T=1": {"temperature": 1.0},
    "T=0.7, top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "T=1, top_p=0.95": {"temperature": 1.0, "top_p": 0.95},
    "top_k=50": {"temperature": 1.0, "top_k": 50},
}


def sort_and_race(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """What GPU rows do (and what the CPU did before its own path)."""
    return exponential_race(filtered_probs(logits, info), info)


TEXTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who had a "
    "secret. Every morning he would walk to the shore and",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\nCrisp "
    "leaves fall gently,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The main causes of the French Revolution were economic hardship, social inequality, and",
]


def model_logits() -> torch.Tensor:
    """Next-token logits ``[positions, vocab]`` float32 of the default model over :data:`TEXTS`."""
    from transformers import AutoModelForCausalLM

    from radixlm.srt import Engine

    engine = Engine(log_level="warning", max_total_tokens=4096)
    try:
        model_dir, tokenizer = engine.scheduler.runner.model_dir, engine.tokenizer
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for text in TEXTS:
            ids = torch.tensor([tokenizer.encode(text)])
            rows.append(model(ids).logits[0].float())
    return torch.cat(rows)


def _info(params: SamplingParams, batch: int, vocab: int, seed: int) -> SamplingBatchInfo:
    return SamplingBatchInfo.build(
        [params] * batch,
        [[] for _ in range(batch)],
        [None] * batch,
        vocab,
        "cpu",
        torch.Generator().manual_seed(seed),
    )


def _best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def beyond_candidates(logits: torch.Tensor, info: SamplingBatchInfo) -> str:
    """Shares of rows whose top-k / top-p cut-off lies beyond the first and the last count of
    the CPU path's candidates."""
    kept = (filtered_probs(logits, info) > 0).sum(dim=-1)
    tiers = sampler_module.CPU_CANDIDATES
    return "/".join(f"{float((kept > tiers[i]).float().mean()):.0%}" for i in (0, -1))


def sampler_alone(args: argparse.Namespace) -> None:
    source = model_logits()
    positions, vocab = source.shape
    print(f"{positions} positions of real logits, {torch.get_num_threads()} threads")
    print(
        f"{'batch':>5} {'vocab':>7}  {'setting':<18}{'sort+race ms':>13}{'CPU path ms':>12}"
        f"{'speed-up':>9}{'beyond':>9}"
    )
    for batch in args.batch_sizes:
        spread = torch.arange(batch) * positions // batch  # rows from every text
        logits = source[spread if batch <= positions else torch.arange(batch) % positions]
        for name, kwargs in SETTINGS.items():
            info = _info(SamplingParams(**kwargs), batch, vocab, seed=1)
            old = _best_ms(lambda i=info, x=logits: sort_and_race(x, i), args.reps)
            new = _best_ms(lambda i=info, x=logits: Sampler().sample(x, i), args.reps)
            beyond = beyond_candidates(logits, info) if info.need_top_p else "-"
            print(
                f"{batch:>5} {vocab:>7}  {name:<18}{old:>13.2f}{new:>12.2f}"
                f"{old / new:>8.1f}x{beyond:>9}",
                flush=True,
            )


def with_engine(args: argparse.Namespace) -> None:
    from radixlm.srt import Engine

    engine = Engine(log_level="warning", max_total_tokens=32768)
    prompts = [f"Write a short story about a {w} and a river." for w in range(args.batch_size)]
    print(
        f"\ndefault model, {args.batch_size} requests x {args.output_len} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'setting':<18}{'sort+race tok/s':>16}{'CPU path tok/s':>15}{'ratio':>7}")
    original = sampler_module.sample_on_cpu

    def tok_per_s(kwargs: dict) -> float:
        params = {**kwargs, "max_new_tokens": args.output_len, "ignore_eos": True}
        best = 0.0
        for _ in range(args.engine_reps):
            engine.flush_cache()
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            elapsed = time.perf_counter() - start
            best = max(best, sum(o["meta_info"]["completion_tokens"] for o in outs) / elapsed)
        return best

    try:
        tok_per_s({"temperature": 1.0})  # warm-up (first forwards, allocator)
        print(f"{'greedy (T=0)':<18}{tok_per_s({'temperature': 0.0}):>16.1f}{'(no sampling)':>15}")
        for name, kwargs in SETTINGS.items():
            rates = []
            for path in (sort_and_race, original):
                sampler_module.sample_on_cpu = path
                rates.append(tok_per_s(kwargs))
            print(f"{name:<18}{rates[0]:>16.1f}{rates[1]:>15.1f}{rates[1] / rates[0]:>6.2f}x")
    finally:
        sampler_module.sample_on_cpu = original
        engine.shutdown()


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--batch-size", type=int, default=16, help="requests in the engine part")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--engine-reps", type=int, default=2)
    args = ap.parse_args(argv)
    sampler_alone(args)
    if not args.skip_engine:
        with_engine(args)


if __name__ == "__main__":
    main()
