"""Shared-prefix workload with the radix cache on and off, in one run.

    python -m radixlm.srt.bench.bench_shared_prefix              # default model: 8 x 16, 1,000-token prefixes
    python -m radixlm.srt.bench.bench_shared_prefix --num-groups 4 --prompts-per-group 8

Each group of requests shares a few-shot prefix, then asks its own short question and gets a
short answer (greedy, EOS ignored, so both runs do the same decoding work). All requests arrive
at once; each is streamed from its own thread, so time to first token is measured per request
from submission to the first generated token. The workload runs on an in-process Engine with
the radix cache, then on a fresh one without it (same pool size, same policy). Printed per run:
requests/s, output tokens/s, mean and median TTFT, and the cache hit rate, sum(cached_tokens) /
sum(prompt_tokens), next to the best possible rate for this workload (every shared-prefix token
of every request after the first of its group, nothing else).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass

from radixlm.srt.bench.datasets import (
    BenchRequest,
    TextTokens,
    best_hit_rate,
    shared_prefix_requests,
)


@dataclass(frozen=True)
class RequestStats:
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class RunStats:
    label: str
    wall_s: float
    reqs: list[RequestStats]

    @property
    def request_throughput(self) -> float:
        return len(self.reqs) / self.wall_s

    @property
    def output_throughput(self) -> float:
        return sum(r.completion_tokens for r in self.reqs) / self.wall_s

    @property
    def hit_rate(self) -> float:
        return sum(r.cached_tokens for r in self.reqs) / sum(r.prompt_tokens for r in self.reqs)

    def ttft(self, stat: str) -> float:
        values = [r.ttft_s for r in self.reqs]
        return statistics.fmean(values) if stat == "mean" else statistics.median(values)


def stream_one(engine, req: BenchRequest, start: threading.Event, out: list, i: int) -> None:
    params = {"temperature": 0, "max_new_tokens": req.output_len, "ignore_eos": True}
    start.wait()
    t0 = time.perf_counter()
    ttft = None
    last = None
    for chunk in engine.generate(input_ids=req.input_ids, sampling_params=params, stream=True):
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        last = chunk
    meta = last["meta_info"]
    assert meta["completion_tokens"] == req.output_len, meta
    out[i] = RequestStats(
        ttft,
        time.perf_counter() - t0,
        meta["prompt_tokens"],
        meta["cached_tokens"],
        meta["completion_tokens"],
    )


def run_workload(engine, reqs: list[BenchRequest], label: str) -> RunStats:
    """Submits every request at once, one streaming thread each; waits for all."""
    out: list[RequestStats | None] = [None] * len(reqs)
    start = threading.Event()
    threads = [
        threading.Thread(target=stream_one, args=(engine, r, start, out, i), daemon=True)
        for i, r in enumerate(reqs)
    ]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any(r is None for r in out):
        raise RuntimeError("some requests failed; see the errors above")
    return RunStats(label, wall, out)  # type: ignore[arg-type]


def run_engine(args: argparse.Namespace, reqs: list[BenchRequest], cache_on: bool) -> RunStats:
    from radixlm.srt import Engine

    engine = Engine(
        model_path=args.model_path,
        log_level="warning",
        max_total_tokens=args.max_total_tokens,
        schedule_policy=args.schedule_policy,
        chunked_prefill_size=args.chunked_prefill_size,
        disable_radix_cache=not cache_on,
    )
    try:
        warm = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        engine.generate(input_ids=reqs[0].input_ids[-64:], sampling_params=warm)
        engine.flush_cache()
        print(f"radix cache {'on' if cache_on else 'off'}: running ...", flush=True)
        stats = run_workload(engine, reqs, "on" if cache_on else "off")
        print(f"  done in {stats.wall_s:.1f} s", flush=True)
        assert engine.scheduler.check_idle(), "KV leak after the run"
    finally:
        engine.shutdown()
    return stats


def print_table(runs: list[RunStats], best: float) -> None:
    print(
        f"{'radix cache':<12}{'req/s':>8}{'out tok/s':>11}{'TTFT mean s':>13}{'TTFT p50 s':>12}"
        f"{'hit rate':>10}{'best':>8}{'wall s':>9}"
    )
    for r in runs:
        print(
            f"{r.label:<12}{r.request_throughput:>8.2f}{r.output_throughput:>11.1f}"
            f"{r.ttft('mean'):>13.2f}{r.ttft('p50'):>12.2f}{r.hit_rate:>10.1%}{best:>8.1%}"
            f"{r.wall_s:>9.1f}"
        )
    by = {r.label: r for r in runs}
    if "on" in by and "off" in by:
        on, off = by["on"], by["off"]
        print(
            f"speedup with the cache: {on.request_throughput / off.request_throughput:.2f}x "
            f"throughput, {off.ttft('mean') / on.ttft('mean'):.2f}x lower mean TTFT; "
            f"hit rate {on.hit_rate:.1%} of best {best:.1%} "
            f"({on.hit_rate / best:.1%} of the best possible)"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct"
    )
    ap.add_argument("--num-groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=1000, help="shared few-shot prefix tokens")
    ap.add_argument("--question-len", type=int, default=24, help="tokens of each question")
    ap.add_argument("--output-len", type=int, default=16, help="tokens of each answer")
    ap.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool of both engines")
    ap.add_argument("--schedule-policy", default="lpm", choices=("fcfs", "lpm", "dfs-weight"))
    ap.add_argument("--chunked-prefill-size", type=int, default=-1)
    ap.add_argument("--only", choices=("on", "off"), default=None, help="run one side only")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from radixlm.srt.models.default_model import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_path))
    reqs = shared_prefix_requests(
        TextTokens(tokenizer, seed=args.seed),
        args.num_groups,
        args.prompts_per_group,
        args.prefix_len,
        args.question_len,
        args.output_len,
        seed=args.seed,
    )
    best = best_hit_rate(reqs)
    print(
        f"{len(reqs)} requests: {args.num_groups} groups x {args.prompts_per_group}, prefix "
        f"{args.prefix_len} + question {args.question_len} tokens, output {args.output_len} "
        f"tokens; policy {args.schedule_policy}, pool {args.max_total_tokens} tokens"
    )
    sides = [args.only == "on"] if args.only else [True, False]
    runs = [run_engine(args, reqs, cache_on) for cache_on in sides]
    print_table(runs, best)


if __name__ == "__main__":
    main()
