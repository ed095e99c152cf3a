"""Online serving benchmark in the style of ``sglang.bench_serving``.

    python -m radixlm.srt.bench.bench_serving --num-prompts 64 --random-input-len 256 \\
        --random-output-len 64 --request-rates 1,4,inf     # starts a server on the default model
    python -m radixlm.srt.bench.bench_serving --base-url http://127.0.0.1:30000 \\
        --dataset-name shared-prefix --request-rate 4 --max-concurrency 16
    python -m radixlm.srt.bench.bench_serving --dummy-8b --dataset-name sharegpt-like \\
        --num-prompts 400 --random-input-len 2048 --random-output-len 256 \\
        --request-rates 2,4,8,16,inf --chunked-prefill-size -1  # GPU: chunking off (8B shapes)

Without ``--base-url`` it starts ``radixlm serve`` on a free port (flags it does not know are
passed to the server, e.g. ``--max-total-tokens 20000``) and stops it at the end; ``--dummy-8b``
serves random weights of Llama-3-8B's shapes (``--load-format dummy``, prompts of random ids).
Requests go to the native ``/generate`` with streaming, token ids as input, greedy and
``ignore_eos`` so every output has exactly the requested length. Arrivals follow a Poisson
process at each rate of ``--request-rates`` requests/s in turn (``inf``: all at once; the same
requests at every rate, the prefix cache flushed in between), with at most
``--max-concurrency`` in flight. Reported per rate: request and token throughput, goodput
(requests/s meeting ``--slo-ttft-s`` and ``--slo-tpot-ms``; with the SLO attainment and the
goodput over the arrival window, which the drain after the last arrival does not dilute), the
prefix-cache hit rate, and mean / p50 / p90 / p99 of time to first token (TTFT), inter-token
latency (ITL), time per output token after the first (TPOT) and end-to-end latency (E2E); then
one line per rate (``serving_report.py`` has the definitions). With ``--worker-urls`` (radixlm workers behind
the router at ``--base-url``), each worker's admitted requests and prefix-cache hit rate.

At capacity (``serving_capacity.py``): prompts longer than the served context are clipped to
fit (the output says how many); ``--goodput ttft:MS tpot:MS`` sets the SLO in milliseconds;
the capacity (the highest rate whose goodput is >= 90% of it) follows the rate table, and
``--capacity-search N`` bisects N more rates towards it; ``--plot FILE.png`` draws TTFT, TPOT
and goodput against the offered rate (matplotlib: the ``plots`` extra). ``--step-timeline
FILE`` has the server it starts write the scheduler's step timeline there
(``RADIXLM_STEP_TIMELINE``; a running server must have been started with it) and prints, per
rate, the share of mixed / prefill / decode steps, the idle share and the mean decode batch
(``step_timeline.py``). ``--dummy-tiny`` is ``--dummy-8b`` on a tiny random Llama (4,096-token
context): the same command runs on a CPU. ``--parts`` (with ``--step-timeline``) then measures
the parts on the same server (the full-chunk prefill rate, decode steps at
``--parts-batch-sizes`` rows of the runs' mean context) and prices each rate's steps at them:
the share of its parts' speed the server delivered (``serving_parts.py``). ``--high-priority-share F`` sends priority
``--high-priority`` (100) on a share F of the requests and 0 on the rest, and reports each
class's TTFT (serve with ``--enable-priority-scheduling``).

Datasets: ``random`` (lengths uniform in [len * range_ratio, len]), ``sharegpt-like``
(lognormal lengths, ShareGPT's long tail: ``--random-input-len`` and ``--random-output-len``
are the means, ``--length-sigma`` the shape, capped at ``--max-input-len`` /
``--max-output-len``; synthetic, nothing downloaded) and ``shared-prefix``
(``--gsp-num-groups`` groups of ``--gsp-prompts-per-group`` requests sharing a
``--gsp-system-prompt-len``-token prefix, then a ``--gsp-question-len``-token question).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson

from radixlm.srt.bench import serving_parts
from radixlm.srt.bench.datasets import (
    BenchRequest,
    RandomTokens,
    TextTokens,
    best_hit_rate,
    long_tailed_requests,
    random_requests,
    shared_prefix_requests,
)
from radixlm.srt.bench.serving_capacity import (
    clip_to_context,
    next_probe,
    parse_goodput,
    plot,
    print_capacity,
    priority_classes,
    ttft_by_priority,
)
from radixlm.srt.bench.serving_parts import DEFAULT_BATCH_SIZES, mean_decode_context
from radixlm.srt.bench.serving_report import (
    RequestOutput,
    Slo,
    print_rate_table,
    print_report,
    read_worker_totals,
    summarize,
    worker_deltas,
)
from radixlm.srt.bench.step_timeline import print_summary, read_records, summarize_steps
from radixlm.srt.scheduler.timeline import ENV_VAR as TIMELINE_ENV

DUMMY_8B_FOLDER = "/tmp/radixlm-llama3-8b-shape"
DUMMY_TINY_FOLDER = "/tmp/radixlm-tiny-llama-shape"


# ---------------------------------------------------------------------- one request
async def _sse_events(resp: httpx.Response) -> AsyncIterator[dict]:
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield orjson.loads(data)


async def send_request(
    client: httpx.AsyncClient, url: str, req: BenchRequest, priority: int | None = None
) -> RequestOutput:
    """Streams one /generate request and times each arriving token."""
    body = {
        "input_ids": req.input_ids,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": req.output_len, "ignore_eos": True},
    }
    if priority is not None:
        body["priority"] = priority
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


class Progress:
    """Prints ``completed/total`` while a rate runs: every tenth of the requests, and at least
    every ``every_s`` seconds while requests complete."""

    def __init__(self, label: str, total: int, every_s: float = 10.0) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.completed = self.failed = 0
        self.start = self.last_print = time.perf_counter()
        self.step = max(1, total // 10)

    def done(self, out: RequestOutput) -> None:
        self.completed += 1
        self.failed += not out.success
        now = time.perf_counter()
        if (
            self.completed % self.step == 0
            or self.completed == self.total
            or now - self.last_print >= self.every_s
        ):
            self.last_print = now
            print(
                f"[{self.label}] {self.completed}/{self.total} done, {self.failed} failed, "
                f"{now - self.start:.1f} s",
                flush=True,
            )


async def run_benchmark(
    url: str,
    reqs: list[BenchRequest],
    rate: float,
    max_concurrency: int | None,
    seed: int,
    progress: Progress | None = None,
    priorities: dict[int, int] | None = None,
) -> tuple[list[RequestOutput], float]:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def one(req: BenchRequest) -> RequestOutput:
            prio = (priorities or {}).get(id(req))
            arrival = time.perf_counter()
            if limit is None:
                out = await send_request(client, url, req, prio)
            else:
                async with limit:
                    out = await send_request(client, url, req, prio)
            out.arrival_s = arrival
            if progress is not None:
                progress.done(out)
            return out

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(req)) async for req in arrivals(reqs, rate, seed)]
        outs = await asyncio.gather(*tasks)
        return list(outs), time.perf_counter() - start


# ---------------------------------------------------------------------- set-up
def build_requests(args: argparse.Namespace, tokenizer) -> list[BenchRequest]:
    if args.random_ids:  # random weights: the tokenizer may not encode the text corpus
        source = RandomTokens(len(tokenizer))
    else:
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
    if args.dataset_name == "sharegpt-like":
        return long_tailed_requests(
            source,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.max_input_len,
            args.max_output_len,
            args.length_sigma,
            args.seed,
        )
    return shared_prefix_requests(
        source,
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        args.seed,
    )


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
    from radixlm.srt.server.process.server_process import ServerProcess

    if args.dummy_8b or args.dummy_tiny:
        from radixlm.srt.bench.bench_gpu import LLAMA3_8B, TINY_LLAMA, make_model_folder

        folder = (
            make_model_folder(Path(DUMMY_8B_FOLDER), dict(LLAMA3_8B))
            if args.dummy_8b
            else make_model_folder(Path(DUMMY_TINY_FOLDER), dict(TINY_LLAMA))
        )
        server_args = ["--model-path", str(folder), "--load-format", "dummy", *server_args]
    if args.step_timeline:
        Path(args.step_timeline).write_bytes(b"")  # this run's steps only
        os.environ[TIMELINE_ENV] = str(Path(args.step_timeline).resolve())
    log = tempfile.NamedTemporaryFile(prefix="radixlm-bench-server-", suffix=".log", delete=False)
    print(f"starting radixlm serve {' '.join(server_args)} (log: {log.name})", flush=True)
    try:
        server = ServerProcess(["--log-level", "warning", *server_args], log_path=log.name)
    except (RuntimeError, TimeoutError):
        print(open(log.name, errors="replace").read()[-3000:])
        raise
    with server:
        yield server.url


def warm_up(url: str, reqs: list[BenchRequest]) -> None:
    body = {"input_ids": reqs[0].input_ids[-16:], "sampling_params": {"max_new_tokens": 4}}
    httpx.post(url + "/generate", json=body, timeout=600).raise_for_status()


def flush_caches(urls: list[str]) -> None:
    for url in urls:
        httpx.post(url.rstrip("/") + "/flush_cache", timeout=60).raise_for_status()


def parse_rates(text: str) -> list[float]:
    """``"2,4,8,inf"`` -> ``[2.0, 4.0, 8.0, inf]``; every rate must be > 0."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"request rates must be numbers or inf: {text!r}") from e
    if not rates or any(not r > 0 for r in rates):  # NaN fails too
        raise argparse.ArgumentTypeError(f"request rates must be > 0 (inf: all at once): {text!r}")
    return rates


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", default=None, help="a running server (default: start one)")
    ap.add_argument(
        "--worker-urls",
        default=None,
        help="comma-separated radixlm workers behind the --base-url router: per-worker figures",
    )
    ap.add_argument("--tokenizer", default=None, help="default: the server's tokenizer path")
    ap.add_argument(
        "--dummy-8b",
        action="store_true",
        help="serve random weights of Llama-3-8B's shapes (GPU); implies --random-ids",
    )
    ap.add_argument(
        "--dummy-tiny",
        action="store_true",
        help="serve random weights of a tiny Llama (CPU smoke runs); implies --random-ids",
    )
    ap.add_argument("--random-ids", action="store_true", help="prompts of random token ids")
    ap.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "sharegpt-like", "shared-prefix", "generated-shared-prefix"),
    )
    ap.add_argument("--num-prompts", type=int, default=64, help="random / sharegpt-like size")
    ap.add_argument("--random-input-len", type=int, default=256, help="(sharegpt-like: mean)")
    ap.add_argument("--random-output-len", type=int, default=64, help="(sharegpt-like: mean)")
    ap.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="lengths uniform in [len * ratio, len]; 1.0 = exact lengths",
    )
    ap.add_argument("--length-sigma", type=float, default=1.0, help="sharegpt-like tail shape")
    ap.add_argument(
        "--max-input-len", type=int, default=6144, help="sharegpt-like cap (+ output <= context)"
    )
    ap.add_argument("--max-output-len", type=int, default=2048, help="sharegpt-like cap")
    ap.add_argument("--gsp-num-groups", type=int, default=8)
    ap.add_argument("--gsp-prompts-per-group", type=int, default=8)
    ap.add_argument("--gsp-system-prompt-len", type=int, default=1000)
    ap.add_argument("--gsp-question-len", type=int, default=32)
    ap.add_argument("--gsp-output-len", type=int, default=32)
    ap.add_argument(
        "--request-rates",
        "--request-rate",
        dest="request_rates",
        type=parse_rates,
        default=[float("inf")],
        help="Poisson arrival rates in requests/s, run in turn: 2,4,8,inf (inf: all at once)",
    )
    ap.add_argument(
        "--rate-prompts",
        default=None,
        metavar="N,N,...",
        help="prompts per rate, one count per --request-rates entry (each rate takes the first N "
        "of the prompts, which are built max(N) strong in place of --num-prompts): e.g. a few "
        "at a low rate for an idle server's figures, many at a saturating one",
    )
    ap.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    ap.add_argument("--slo-ttft-s", type=float, default=1.0, help="goodput: TTFT limit")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput: TPOT limit")
    ap.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="goodput SLO in milliseconds: ttft:MS tpot:MS (instead of --slo-ttft-s/--slo-tpot-ms)",
    )
    ap.add_argument(
        "--capacity-search",
        type=int,
        default=0,
        metavar="N",
        help="after the rates, N more bisecting towards the capacity (goodput >= 90%% of rate)",
    )
    ap.add_argument("--plot", default=None, help="PNG of TTFT, TPOT, goodput against the rate")
    ap.add_argument(
        "--step-timeline",
        default=None,
        help="scheduler step timeline file (the started server writes it); summarised per rate",
    )
    ap.add_argument(
        "--parts",
        action="store_true",
        help="after the rates, measure the full-chunk prefill rate and decode steps at "
        "--parts-batch-sizes on the same server and price each rate's steps at them "
        "(needs --step-timeline; serving_parts.py)",
    )
    ap.add_argument(
        "--parts-batch-sizes",
        default=",".join(map(str, DEFAULT_BATCH_SIZES)),
        help="decode batch sizes --parts measures (comma list)",
    )
    ap.add_argument(
        "--parts-prompt-len",
        type=int,
        default=0,
        help="prompt tokens of --parts' decode requests (0: the mean context of the runs' decode "
        "rows)",
    )
    ap.add_argument("--parts-decode-tokens", type=int, default=32, help="tokens each decodes")
    ap.add_argument(
        "--high-priority-share",
        type=float,
        default=0.0,
        help="this share of requests sends priority --high-priority, the rest priority 0 "
        "(serve with --enable-priority-scheduling); TTFT is then reported per class",
    )
    ap.add_argument("--high-priority", type=int, default=100, help="the high class's priority")
    ap.add_argument("--no-flush-cache", action="store_true", help="keep the server's prefix cache")
    ap.add_argument("--output-file", default=None, help="append each rate's results (JSON lines)")
    ap.add_argument(
        "--label",
        default=None,
        help="names this run's variant in --output-file records (serving_compare.py's table)",
    )
    ap.add_argument("--seed", type=int, default=1)
    args, server_args = ap.parse_known_args(argv)
    if args.rate_prompts is not None:
        try:
            counts = [int(n) for n in args.rate_prompts.split(",")]
        except ValueError:
            ap.error(f"--rate-prompts wants integers, got {args.rate_prompts!r}")
        if len(counts) != len(args.request_rates) or min(counts) < 1:
            ap.error("--rate-prompts wants one count >= 1 per --request-rates entry")
        if args.capacity_search:
            ap.error("--rate-prompts and --capacity-search: give one of them")
        args.rate_prompts = counts
        args.num_prompts = max(counts)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    if not (args.slo_ttft_s > 0 and args.slo_tpot_ms > 0):
        ap.error("--slo-ttft-s and --slo-tpot-ms must be > 0")
    if args.goodput:
        try:
            vars(args).update(parse_goodput(args.goodput))
        except ValueError as e:
            ap.error(str(e))
    if not 0 <= args.high_priority_share <= 1:
        ap.error("--high-priority-share must be in [0, 1]")
    if args.capacity_search < 0:
        ap.error("--capacity-search must be >= 0")
    if args.dummy_8b and args.dummy_tiny:
        ap.error("give one of --dummy-8b and --dummy-tiny")
    if args.parts:
        if not args.step_timeline:
            ap.error("--parts needs --step-timeline")
        try:
            args.parts_batch_sizes = sorted({int(b) for b in args.parts_batch_sizes.split(",")})
        except ValueError:
            ap.error(f"--parts-batch-sizes wants integers, got {args.parts_batch_sizes!r}")
        if (
            args.parts_batch_sizes[0] < 1
            or args.parts_decode_tokens < 2
            or args.parts_prompt_len < 0
        ):
            ap.error(
                "--parts-batch-sizes >= 1, --parts-decode-tokens >= 2, --parts-prompt-len >= 0"
            )
    args.worker_urls = [u for u in (args.worker_urls or "").split(",") if u]
    args.random_ids = args.random_ids or args.dummy_8b or args.dummy_tiny
    return args, server_args


def run_rate(
    args: argparse.Namespace, url: str, reqs: list[BenchRequest], rate: float, best: float | None
) -> dict:
    """One rate: flush, run, summarize, print; the summary (with per-worker figures)."""
    if not args.no_flush_cache:
        flush_caches(args.worker_urls or [url])
    before = read_worker_totals(args.worker_urls) if args.worker_urls else []
    progress = Progress(f"rate {rate:g}", len(reqs))
    priorities = priority_classes(reqs, args.high_priority_share, args.high_priority, args.seed)
    outs, duration = asyncio.run(
        run_benchmark(url, reqs, rate, args.max_concurrency, args.seed, progress, priorities)
    )
    summary = summarize(outs, duration, Slo(args.slo_ttft_s, args.slo_tpot_ms))
    if priorities:
        summary["by_priority"] = ttft_by_priority(reqs, outs, priorities)
    if args.worker_urls:
        after = read_worker_totals(args.worker_urls)
        summary["workers"] = worker_deltas(args.worker_urls, before, after)
    for o in [o for o in outs if not o.success][:5]:
        print(f"failed request: {o.error}")
    header = [
        ("Dataset", args.dataset_name),
        ("Request rate (req/s)", rate),
        ("Max concurrency", args.max_concurrency or "-"),
    ]
    print_report(summary, header, best)
    if args.step_timeline and Path(args.step_timeline).exists():
        records, args.timeline_offset = read_records(args.step_timeline, args.timeline_offset)
        args.timeline_slices.append(records)
        summary["step_timeline"] = summarize_steps(records)
        print_summary(summary["step_timeline"], f" (rate {rate:g})")
    return summary


def run_parts(
    args: argparse.Namespace, info_url: str, url: str, rates: list[float], summaries: list[dict]
) -> None:
    """``--parts``: the parts measured on the server after the rates, each rate priced at them
    (``summary["sum_of_parts"]``)."""
    info = httpx.get(info_url + "/server_info", timeout=30).json()
    prompt_len = args.parts_prompt_len or round(
        mean_decode_context([s for sl in args.timeline_slices for s in sl]) or 1024
    )
    flush_caches(args.worker_urls or [url])
    chunk = int(info.get("chunked_prefill_size") or 0)
    parts = serving_parts.measure(
        url,
        args.step_timeline,
        args.timeline_offset,
        vocab=int(info["vocab_size"]),
        chunk=chunk if chunk > 0 else 8192,  # -1: chunking off
        max_prompt=int(info["max_req_input_len"]),
        prompt_len=prompt_len,
        batch_sizes=args.parts_batch_sizes,
        decode_tokens=args.parts_decode_tokens,
        seed=args.seed,
    )
    serving_parts.print_parts(parts)
    for rate, records, summary in zip(rates, args.timeline_slices, summaries, strict=True):
        priced = serving_parts.price(records, parts)
        serving_parts.print_priced(rate, priced)
        summary["sum_of_parts"] = priced
    for summary in summaries:
        summary["parts"] = parts


def fit_context(url: str, reqs: list[BenchRequest]) -> list[BenchRequest]:
    """The requests clipped to the server's context (prompt + output); says how many were.
    ``url`` is a server, or a worker behind the router (a router in PD mode has no
    ``/server_info``)."""
    info = httpx.get(url + "/server_info", timeout=30).json()
    limit = int(info["max_req_input_len"]) + 1
    reqs, clipped = clip_to_context(reqs, limit)
    if clipped:
        print(
            f"clipped {clipped} of {len(reqs)} requests to fit the served context of {limit} "
            "tokens (prompt + output)",
            flush=True,
        )
    return reqs


def main(argv: list[str] | None = None) -> list[dict]:
    """Runs every rate; returns one summary per rate."""
    args, server_args = parse_args(argv)
    summaries: list[dict] = []
    rates: list[float] = []
    args.timeline_offset = 0
    args.timeline_slices = []  # each rate's steps (--parts prices them)
    with server_url(args, server_args) as url:
        info_url = args.worker_urls[0] if args.worker_urls else url
        reqs = fit_context(info_url, build_requests(args, load_tokenizer(args, info_url)))
        best = best_hit_rate(reqs) if args.dataset_name not in ("random", "sharegpt-like") else None
        warm_up(url, reqs)
        if args.step_timeline and Path(args.step_timeline).exists():  # not the warm-up's steps
            args.timeline_offset = Path(args.step_timeline).stat().st_size
        queue = list(args.request_rates)
        counts = list(args.rate_prompts or [len(reqs)] * len(queue))
        searches = args.capacity_search
        while queue:
            rate = queue.pop(0)
            count = counts.pop(0) if counts else len(reqs)
            subset = reqs[:count]
            subset_best = best if count == len(reqs) or best is None else best_hit_rate(subset)
            summary = run_rate(args, url, subset, rate, subset_best)
            rates.append(rate)
            summaries.append(summary)
            if args.output_file:
                with open(args.output_file, "ab") as f:
                    record = {
                        "args": vars(args),
                        "server_args": server_args,
                        "label": args.label,
                        "request_rate": rate,
                        **summary,
                    }
                    f.write(orjson.dumps(record, default=str) + b"\n")
            if not queue and searches > 0 and (probe := next_probe(rates, summaries)):
                searches -= 1
                queue.append(probe)
        if args.parts and summaries and len(args.timeline_slices) == len(summaries):
            run_parts(args, info_url, url, rates, summaries)
        elif args.parts:
            print(f"--parts: no step timeline at {args.step_timeline}; nothing measured")
    if len(summaries) > 1:
        order = sorted(range(len(rates)), key=lambda i: rates[i])
        print_rate_table([rates[i] for i in order], [summaries[i] for i in order])
        print_capacity(rates, summaries)
    if args.plot:
        plot(rates, summaries, args.plot)
    return summaries


if __name__ == "__main__":
    main()
