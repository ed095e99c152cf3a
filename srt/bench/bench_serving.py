"""Online serving benchmark in the style of ``sglang.bench_serving``.

    python -m radixlm.srt.bench.bench_serving --num-prompts 64 --random-input-len 256 \\
        --random-output-len 64 --request-rate inf            # starts a server on the default model
    python -m radixlm.srt.bench.bench_serving --base-url http://127.0.0.1:30000 \\
        --dataset-name shared-prefix --request-rate 4 --max-concurrency 16

Without ``--base-url`` it starts ``radixlm serve`` on a free port (flags it does not know are
passed to the server, e.g. ``--max-total-tokens 20000``) and stops it at the end. Requests go to
the native ``/generate`` with streaming, token ids as input, greedy and ``ignore_eos`` so every
output has exactly the requested length. Arrivals follow a Poisson process at
``--request-rate`` requests/s (``inf``: all at once), with at most ``--max-concurrency`` in
flight. Reported: request and token throughput, the prefix-cache hit rate, and mean / median /
p90 / p99 of time to first token (TTFT), inter-token latency (ITL: gaps between streamed
tokens), time per output token after the first (TPOT) and end-to-end latency (E2E).

Datasets: ``random`` (lengths uniform in [len * range_ratio, len]) and ``shared-prefix``
(``--gsp-num-groups`` groups of ``--gsp-prompts-per-group`` requests sharing a
``--gsp-system-prompt-len``-token prefix, then a ``--gsp-question-len``-token question).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import numpy as np
import orjson

from radixlm.srt.bench.datasets import (
    BenchRequest,
    TextTokens,
    best_hit_rate,
    random_requests,
    shared_prefix_requests,
)


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # one gap per streamed token after the first


# ---------------------------------------------------------------------- one request
async def _sse_events(resp: httpx.Response) -> AsyncIterator[dict]:
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield orjson.loads(data)


async def send_request(client: httpx.AsyncClient, url: str, req: BenchRequest) -> RequestOutput:
    """Streams one /generate request and times each arriving token."""
    body = {
        "input_ids": req.input_ids,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": req.output_len, "ignore_eos": True},
    }
    out = RequestOutput(prompt_len=len(req.input_ids))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/generate", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return out
            async for event in _sse_events(resp):
                if "error" in event:
                    out.error = str(event["error"])
                    return out
                now = time.perf_counter()
                meta = event["meta_info"]
                new = meta["completion_tokens"] - out.output_len
                if new > 0 and out.output_len == 0:
                    out.ttft_s = now - start
                elif new > 0:  # an event may carry several tokens: spread the gap over them
                    out.itl_s += [(now - last) / new] * new
                if new > 0:
                    last = now
                out.output_len = meta["completion_tokens"]
                out.cached_tokens = meta.get("cached_tokens", 0)
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.latency_s = time.perf_counter() - start
    out.success = out.output_len == req.output_len
    if not out.success:
        out.error = f"got {out.output_len} output tokens, expected {req.output_len}"
    return out


# ---------------------------------------------------------------------- the run
async def arrivals(reqs: list[BenchRequest], rate: float, seed: int) -> AsyncIterator[BenchRequest]:
    """The requests at Poisson arrival times (all at once for an infinite rate)."""
    rng = random.Random(seed)
    for req in reqs:
        yield req
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(
    url: str, reqs: list[BenchRequest], rate: float, max_concurrency: int | None, seed: int
) -> tuple[list[RequestOutput], float]:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def one(req: BenchRequest) -> RequestOutput:
            if limit is None:
                return await send_request(client, url, req)
            async with limit:
                return await send_request(client, url, req)

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(req)) async for req in arrivals(reqs, rate, seed)]
        outs = await asyncio.gather(*tasks)
        return list(outs), time.perf_counter() - start


# ---------------------------------------------------------------------- report
def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1000.0
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(outs: list[RequestOutput], duration_s: float) -> dict:
    ok = [o for o in outs if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_len for o in ok)
    tpot = [(o.latency_s - o.ttft_s) / (o.output_len - 1) for o in ok if o.output_len > 1]
    return {
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "hit_rate": sum(o.cached_tokens for o in ok) / input_tokens if input_tokens else 0.0,
        "ttft_ms": _percentiles([o.ttft_s for o in ok]),
        "itl_ms": _percentiles([x for o in ok for x in o.itl_s]),
        "tpot_ms": _percentiles(tpot),
        "e2e_ms": _percentiles([o.latency_s for o in ok]),
    }


def print_report(s: dict, args: argparse.Namespace, best: float | None) -> None:
    rows = [
        ("Dataset", args.dataset_name),
        ("Request rate (req/s)", args.request_rate),
        ("Max concurrency", args.max_concurrency or "-"),
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["input_tokens"]),
        ("Total output tokens", s["output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{s['input_throughput']:.1f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        (
            "Cache hit rate",
            f"{s['hit_rate']:.1%}" + (f" (best possible {best:.1%})" if best is not None else ""),
        ),
    ]
    print(f"{' Serving benchmark ':=^56}")
    for name, value in rows:
        print(f"{name:<36}{value!s:>20}")
    print(f"{'latency (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for label, key in (
        ("TTFT", "ttft_ms"),
        ("ITL", "itl_ms"),
        ("TPOT", "tpot_ms"),
        ("E2E", "e2e_ms"),
    ):
        p = s[key]
        print(f"{label:<16}{p['mean']:>10.1f}{p['p50']:>10.1f}{p['p90']:>10.1f}{p['p99']:>10.1f}")
    print("=" * 56)


# ---------------------------------------------------------------------- set-up
def build_requests(args: argparse.Namespace, tokenizer) -> list[BenchRequest]:
    source = TextTokens(tokenizer, seed=args.seed)
    if args.dataset_name == "random":
        return random_requests(
            source,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    reqs = shared_prefix_requests(
        source,
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        args.seed,
    )
    return reqs


def load_tokenizer(args: argparse.Namespace, url: str):
    from transformers import AutoTokenizer

    path = args.tokenizer
    if path is None:
        info = httpx.get(url + "/get_model_info", timeout=30).json()
        path = info.get("tokenizer_path") or info["model_path"]
    return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def server_url(args: argparse.Namespace, server_args: list[str]) -> Iterator[str]:
    """The given ``--base-url``, or a server started for the run."""
    if args.base_url:
        if server_args:
            raise ValueError(f"unknown arguments {server_args} (server flags need no --base-url)")
        yield args.base_url.rstrip("/")
        return
    from radixlm.srt.server.server_process import ServerProcess

    log = tempfile.NamedTemporaryFile(prefix="radixlm-bench-server-", suffix=".log", delete=False)
    print(f"starting radixlm serve {' '.join(server_args)} (log: {log.name})")
    try:
        server = ServerProcess(["--log-level", "warning", *server_args], log_path=log.name)
    except (RuntimeError, TimeoutError):
        print(open(log.name, errors="replace").read()[-3000:])
        raise
    with server:
        yield server.url


def warm_up(url: str, reqs: list[BenchRequest], flush: bool) -> None:
    body = {"input_ids": reqs[0].input_ids[-16:], "sampling_params": {"max_new_tokens": 4}}
    httpx.post(url + "/generate", json=body, timeout=600).raise_for_status()
    if flush:
        httpx.post(url + "/flush_cache", timeout=60).raise_for_status()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", default=None, help="a running server (default: start one)")
    ap.add_argument("--tokenizer", default=None, help="default: the server's tokenizer path")
    ap.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "shared-prefix", "generated-shared-prefix"),
    )
    ap.add_argument("--num-prompts", type=int, default=64, help="random dataset size")
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=64)
    ap.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="lengths uniform in [len * ratio, len]; 1.0 = exact lengths",
    )
    ap.add_argument("--gsp-num-groups", type=int, default=8)
    ap.add_argument("--gsp-prompts-per-group", type=int, default=8)
    ap.add_argument("--gsp-system-prompt-len", type=int, default=1000)
    ap.add_argument("--gsp-question-len", type=int, default=32)
    ap.add_argument("--gsp-output-len", type=int, default=32)
    ap.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate in requests/s (inf: all at once)",
    )
    ap.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    ap.add_argument("--no-flush-cache", action="store_true", help="keep the server's prefix cache")
    ap.add_argument("--output-file", default=None, help="append the results as one JSON line")
    ap.add_argument("--seed", type=int, default=1)
    args, server_args = ap.parse_known_args(argv)
    if args.request_rate <= 0:
        ap.error("--request-rate must be > 0 (inf for all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    return args, server_args


def main(argv: list[str] | None = None) -> dict:
    args, server_args = parse_args(argv)
    with server_url(args, server_args) as url:
        reqs = build_requests(args, load_tokenizer(args, url))
        best = best_hit_rate(reqs) if args.dataset_name != "random" else None
        warm_up(url, reqs, flush=not args.no_flush_cache)
        outs, duration = asyncio.run(
            run_benchmark(url, reqs, args.request_rate, args.max_concurrency, args.seed)
        )
    summary = summarize(outs, duration)
    for o in [o for o in outs if not o.success][:5]:
        print(f"failed request: {o.error}")
    print_report(summary, args, best)
    if args.output_file:
        with open(args.output_file, "ab") as f:
            f.write(orjson.dumps({"args": vars(args), **summary}) + b"\n")
    return summary


if __name__ == "__main__":
    main()
