"""Multi-turn chat / agent workload over the KV tiers: device only, host memory, disk, restart.

    python -m radixlm.srt.bench.bench_multiturn --quick      # CPU smoke run: 12 x 4 rounds
    python -m radixlm.srt.bench.bench_multiturn --num-conversations 12 --num-rounds 4 \\
        --turn-len 96 --output-len 8                          # medium CPU run (2 cores: ~6 min)
    python -m radixlm.srt.bench.bench_multiturn --dummy-8b --attention-backend triton  # GPU
    python -m radixlm.srt.bench.bench_multiturn --modes host,disk,restart --write-policy write_back

Each of ``--num-conversations`` conversations runs ``--num-rounds`` rounds: a round appends
``--turn-len`` new user tokens to the conversation's history, generates ``--output-len`` tokens
(greedy, EOS ignored) and appends them too; the next round's prompt is the whole history. Rounds
are issued by ``--concurrency`` client threads, each taking the next ready (conversation, round)
of a seeded shuffled schedule; a conversation's next round starts only after its previous one
finished. Every request is streamed, so TTFT is measured from submission to the first token.
``--replies fixed`` appends pre-drawn tokens instead of the generated ones, so every mode sends
the same prompts even where greedy outputs differ (random weights in bf16 flip near-ties).

The device KV pool holds about 1 / ``--overflow`` of the workload's live KV, so conversations
are evicted between their rounds. Modes, each on a fresh in-process Engine:
``device`` (radix cache, no hierarchical cache), ``host`` (host-memory tier of ``--hicache-ratio``
x the device pool), ``disk`` (a small host tier, ``--disk-host-ratio``, over a disk folder that
starts empty), ``restart`` (a new Engine over the folder ``disk`` filled: its device and host
tiers start empty) and ``off`` (no prefix cache; not run unless asked for). Printed: mean TTFT
per round and mode, throughput, hit rates per tier (from the server's tier counters over the
run), loads skipped, and the ratios the hierarchical cache is judged by.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from radixlm.srt.bench.datasets import RandomTokens, TextTokens, multiturn_turns
from radixlm.srt.bench.multiturn_report import (
    FROM_ROUND,
    TIER_COUNTERS,
    print_hits,
    print_outputs_check,
    print_ratios,
    print_rounds,
    print_throughput,
)
from radixlm.srt.bench.plots import plot_ttft_per_round

MODES = ("device", "host", "disk", "restart", "off")
HICACHE_MODES = ("host", "disk", "restart")
QUICK = dict(num_conversations=12, num_rounds=4, turn_len=48, output_len=8)


@dataclass(frozen=True)
class Workload:
    turns: list[list[list[int]]]  # turns[c][r]: new user tokens of conversation c, round r
    output_len: int
    # replies[c][r]: what round r appends after generating (None: the generated tokens)
    replies: list[list[list[int]]] | None = None

    @property
    def num_rounds(self) -> int:
        return len(self.turns[0])

    @property
    def num_requests(self) -> int:
        return len(self.turns) * self.num_rounds

    def conversation_tokens(self, c: int) -> int:
        """KV tokens conversation ``c`` holds after its last round."""
        return sum(len(t) for t in self.turns[c]) + self.num_rounds * self.output_len

    def live_tokens(self) -> int:
        return sum(self.conversation_tokens(c) for c in range(len(self.turns)))


@dataclass(frozen=True)
class RequestStats:
    conversation: int
    round: int  # 0-based
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class ModeRun:
    mode: str
    wall_s: float = 0.0
    reqs: list[RequestStats] = field(default_factory=list)
    outputs: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    # gaps[(c, r)][i]: top-1 minus top-2 logprob at output token i (how near a tie it was)
    gaps: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    tiers: dict[str, float] | None = None  # tier counters over the run (hierarchical modes)
    disk: dict[str, float] | None = None  # the disk store's figures at the end of the run
    phases: dict[str, float] | None = None  # scheduler-thread seconds per tier phase, rates
    error: str | None = None

    def ttft(self, rounds: set[int] | None = None) -> float:
        values = [r.ttft_s for r in self.reqs if rounds is None or r.round in rounds]
        return statistics.fmean(values) if values else float("nan")

    def ttft_steady(self) -> float:
        return self.ttft({r.round for r in self.reqs if r.round >= FROM_ROUND - 1})

    @property
    def hit_rate(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.reqs)
        return sum(r.cached_tokens for r in self.reqs) / prompt if prompt else 0.0

    def queried_split(self) -> dict[str, float | None]:
        """The server's figures: tier hit tokens / queried tokens (every admission attempt)."""
        queried = (self.tiers or {}).get("queried_tokens")
        if not queried:
            return {"device": None, "host": None, "disk": None}
        return {t: self.tiers[f"{t}_hit_tokens"] / queried for t in ("device", "host", "disk")}


class Schedule:
    """A seeded shuffled order of (conversation, round); ``take`` hands out the first one whose
    conversation has no round in flight (rounds of a conversation come out in order)."""

    def __init__(self, num_conversations: int, num_rounds: int, seed: int) -> None:
        self._pending = [c for c in range(num_conversations) for _ in range(num_rounds)]
        random.Random(seed).shuffle(self._pending)
        self._next_round = [0] * num_conversations
        self._busy: set[int] = set()
        self._cond = threading.Condition()

    def take(self) -> tuple[int, int] | None:
        """The next ready (conversation, round), waiting while all are busy; None when done."""
        with self._cond:
            while self._pending:
                for i, c in enumerate(self._pending):
                    if c not in self._busy:
                        del self._pending[i]
                        self._busy.add(c)
                        self._next_round[c] += 1
                        return c, self._next_round[c] - 1
                self._cond.wait()
            return None

    def done(self, conversation: int) -> None:
        with self._cond:
            self._busy.discard(conversation)
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self._pending.clear()
            self._cond.notify_all()


def stream_request(engine, prompt: list[int], output_len: int) -> tuple[float, float, dict]:
    """(TTFT, latency, final chunk) of one streamed greedy request."""
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    last = None
    # the top two logprobs of each output token (no input logprobs): how near a tie each
    # greedy pick was, for the outputs check
    stream = engine.generate(
        input_ids=prompt,
        sampling_params=params,
        stream=True,
        return_logprob=True,
        top_logprobs_num=2,
    )
    for chunk in stream:
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        last = chunk
    assert last is not None and ttft is not None, "the stream ended without a token"
    meta = last["meta_info"]
    assert meta["completion_tokens"] == output_len, meta
    return ttft, time.perf_counter() - t0, last


class Clients:
    """``concurrency`` threads running the workload's schedule on one engine."""

    def __init__(self, engine, workload: Workload, run: ModeRun, seed: int) -> None:
        self.engine, self.workload, self.run = engine, workload, run
        self.schedule = Schedule(len(workload.turns), workload.num_rounds, seed)
        self.histories: list[list[int]] = [[] for _ in workload.turns]
        self.lock = threading.Lock()
        self.errors: list[str] = []

    def client(self) -> None:
        while (item := self.schedule.take()) is not None:
            c, r = item
            try:
                self.one_round(c, r)
            except Exception:  # noqa: BLE001 - reported after the run; the rest stop
                self.errors.append(traceback.format_exc())
                self.schedule.cancel()
            finally:
                self.schedule.done(c)

    def one_round(self, c: int, r: int) -> None:
        prompt = self.histories[c] + self.workload.turns[c][r]
        ttft, latency, last = stream_request(self.engine, prompt, self.workload.output_len)
        meta, output_ids = last["meta_info"], last["output_ids"]
        reply = output_ids if self.workload.replies is None else self.workload.replies[c][r]
        self.histories[c] = prompt + reply
        stats = RequestStats(
            c,
            r,
            ttft,
            latency,
            meta["prompt_tokens"],
            meta["cached_tokens"],
            meta["completion_tokens"],
        )
        with self.lock:
            self.run.reqs.append(stats)
            self.run.outputs[(c, r)] = output_ids
            self.run.gaps[(c, r)] = top2_gaps(meta)

    def run_all(self, concurrency: int, progress_s: float) -> None:
        threads = [threading.Thread(target=self.client, daemon=True) for _ in range(concurrency)]
        stop = threading.Event()
        t0 = time.perf_counter()
        reporter = threading.Thread(target=self.report, args=(stop, t0, progress_s), daemon=True)
        for t in [*threads, reporter]:
            t.start()
        for t in threads:
            t.join()
        self.run.wall_s = time.perf_counter() - t0
        stop.set()
        reporter.join()
        if self.errors:
            raise RuntimeError("a request failed:\n" + self.errors[0])

    def report(self, stop: threading.Event, t0: float, every_s: float) -> None:
        total = self.workload.num_requests
        while not stop.wait(every_s):
            n = len(self.run.reqs)
            elapsed = time.perf_counter() - t0
            print(f"  {self.run.mode}: {n}/{total} requests, {elapsed:.1f} s", flush=True)


def top2_gaps(meta: dict) -> list[float]:
    """Top-1 minus top-2 logprob of each output token (inf where the engine gave fewer)."""
    gaps = []
    for top in meta.get("output_top_logprobs") or []:
        gaps.append(top[0][0] - top[1][0] if top and len(top) > 1 else float("inf"))
    return gaps


def tier_counters(engine) -> dict | None:
    return engine.get_server_info().get("hicache")


def tier_delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in TIER_COUNTERS}


def engine_options(args: argparse.Namespace, mode: str, storage_dir: str) -> dict:
    opts = dict(
        model_path=args.model_path,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        log_level="warning",
        max_total_tokens=args.max_total_tokens,
        page_size=args.page_size,
        schedule_policy=args.schedule_policy,
        disable_radix_cache=mode == "off",
    )
    if mode in HICACHE_MODES:
        opts.update(
            enable_hierarchical_cache=True,
            hicache_write_policy=args.write_policy,
            hicache_ratio=args.hicache_ratio,
        )
    if mode in ("disk", "restart"):
        opts.update(
            hicache_ratio=args.disk_host_ratio,
            hicache_storage_dir=storage_dir,
            hicache_storage_max_bytes=int(args.storage_max_gb * 2**30),
        )
    return opts


def run_mode(args: argparse.Namespace, mode: str, workload: Workload, storage_dir: str) -> ModeRun:
    from radixlm.srt import Engine
    from radixlm.srt.bench.bench_gpu import release

    run = ModeRun(mode)
    engine = None
    try:
        engine = Engine(**engine_options(args, mode, storage_dir))
        warm = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        turn = workload.turns[0][-1]  # rotated: no prompt starts like it, no disk page matches
        engine.generate(input_ids=turn[1:] + turn[:1], sampling_params=warm)
        engine.flush_cache()  # keeps the disk tier: restart still starts warm from it
        before = tier_counters(engine)
        print(f"{mode}: running ...", flush=True)
        Clients(engine, workload, run, args.seed).run_all(args.concurrency, args.progress_s)
        print(f"  {mode}: done in {run.wall_s:.1f} s", flush=True)
        assert engine.scheduler.check_idle(), f"KV leak after the {mode} run"
        after = tier_counters(engine)
        if after is not None:
            run.tiers = tier_delta(before or {}, after)
            if mode in ("disk", "restart"):
                run.disk = {k: v for k, v in after.items() if k.startswith("disk_")}
                run.disk.update(disk_path_rates(after, storage_dir))
            run.phases = {
                **after.get("phase_seconds", {}),
                "prefill_us_per_token": 1e6 * (after.get("prefill_s_per_token") or 0),
                "disk_us_per_token": 1e6 * (after.get("disk_s_per_token") or 0),
            }
    except Exception:  # noqa: BLE001 - one failing mode must not hide the others
        run.error = traceback.format_exc()
        print(f"{mode} FAILED:\n{run.error}", flush=True)
    finally:
        if engine is not None:
            release(engine)
    return run


def disk_path_rates(tiers: dict, storage_dir: str) -> dict[str, float]:
    """The disk-hit path's bytes/s over the run (pages read / the scheduler's seconds waiting
    for them and putting them into the host pool) beside a raw read of the same folder now."""
    from radixlm.srt.bench.bench_disk_path import raw_read_rate

    phases = tiers.get("phase_seconds", {})
    path_s = phases.get("disk_wait", 0.0) + phases.get("disk_to_host", 0.0)
    raw_bytes, raw_s = raw_read_rate(storage_dir)
    return {
        "path_bytes_per_s": tiers.get("disk_read_bytes", 0) / path_s if path_s else 0.0,
        "raw_read_bytes_per_s": raw_bytes / raw_s if raw_s else 0.0,
    }


def default_pool_tokens(workload: Workload, overflow: float, page_size: int, clients: int) -> int:
    """The workload's live KV / ``overflow``, in whole pages, but at least the longest
    conversation plus half of it for each other client (their requests run beside it)."""
    pages = lambda n: -(-int(n) // page_size) * page_size  # noqa: E731 - round up to pages
    longest = max(workload.conversation_tokens(c) for c in range(len(workload.turns)))
    floor = longest * (1 + (clients - 1) / 2)
    return max(pages(workload.live_tokens() / overflow), pages(floor))


def build_workload(args: argparse.Namespace) -> Workload:
    from transformers import AutoConfig, AutoTokenizer

    from radixlm.srt.models.default_model import resolve_model_path

    folder = resolve_model_path(args.model_path, need_weights=args.load_format != "dummy")
    if args.load_format == "dummy":  # random weights: the tokenizer may not encode the corpus
        source = RandomTokens(AutoConfig.from_pretrained(folder).vocab_size)
    else:
        source = TextTokens(AutoTokenizer.from_pretrained(folder), seed=args.seed)
    turns = multiturn_turns(
        source, args.num_conversations, args.num_rounds, args.turn_len, seed=args.seed
    )
    replies = None
    if args.replies == "fixed":
        replies = multiturn_turns(
            source, args.num_conversations, args.num_rounds, args.output_len, seed=args.seed + 1
        )
    return Workload(turns, args.output_len, replies)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument(
        "--dummy-8b",
        action="store_true",
        help="a Llama-3-8B-shaped model with random weights (GPU; see bench_gpu)",
    )
    ap.add_argument("--dummy-folder", default="/tmp/radixlm-llama3-8b-shape")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: " + str(QUICK))
    ap.add_argument("--num-conversations", type=int, default=40)
    ap.add_argument("--num-rounds", type=int, default=8)
    ap.add_argument("--turn-len", type=int, default=512, help="new user tokens per round")
    ap.add_argument("--output-len", type=int, default=64, help="generated tokens per round")
    ap.add_argument(
        "--replies",
        default="generated",
        choices=("generated", "fixed"),
        help="what a round appends to the history: the generated tokens, or fixed random ones "
        "(every mode then sends the same prompts, whatever the numerics)",
    )
    ap.add_argument("--concurrency", type=int, default=4, help="client threads")
    ap.add_argument(
        "--modes",
        default="device,host,disk,restart",
        help=f"comma-separated, from {','.join(MODES)} ('all': every one)",
    )
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="device KV pool (default: the workload's live KV / --overflow)",
    )
    ap.add_argument("--overflow", type=float, default=4.0)
    ap.add_argument("--page-size", type=int, default=16, help="for every mode alike")
    ap.add_argument(
        "--write-policy",
        default="write_through",
        choices=("write_through", "write_through_selective", "write_back"),
    )
    ap.add_argument("--hicache-ratio", type=float, default=4.0, help="host pool / device pool")
    ap.add_argument(
        "--disk-host-ratio",
        type=float,
        default=0.5,
        help="host pool / device pool in the disk and restart modes",
    )
    ap.add_argument("--storage-dir", default=None, help="disk tier folder (default: a temp dir)")
    ap.add_argument("--storage-max-gb", type=float, default=64.0)
    ap.add_argument("--schedule-policy", default="lpm", choices=("fcfs", "lpm", "dfs-weight"))
    ap.add_argument("--progress-s", type=float, default=5.0, help="seconds between progress lines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="also write TTFT per round and tier as this PNG")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.modes = list(MODES) if args.modes == "all" else args.modes.split(",")
    unknown = set(args.modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    if "restart" in args.modes and "disk" not in args.modes and not args.storage_dir:
        ap.error("restart without disk needs --storage-dir (a folder a disk run filled)")
    return args


def prepare_model(args: argparse.Namespace) -> None:
    if args.dummy_8b:
        from radixlm.srt.bench.bench_gpu import LLAMA3_8B, make_model_folder

        args.model_path = str(make_model_folder(Path(args.dummy_folder), dict(LLAMA3_8B)))
        args.load_format = "dummy"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prepare_model(args)
    workload = build_workload(args)
    if args.max_total_tokens is None:
        args.max_total_tokens = default_pool_tokens(
            workload, args.overflow, args.page_size, args.concurrency
        )
    live = workload.live_tokens()
    print(
        f"{workload.num_requests} requests: {args.num_conversations} conversations x "
        f"{args.num_rounds} rounds, turn {args.turn_len} + output {args.output_len} tokens "
        f"({args.replies} replies appended), "
        f"{args.concurrency} clients; live KV {live} tokens = "
        f"{live / args.max_total_tokens:.1f}x the device pool of {args.max_total_tokens}; "
        f"page {args.page_size}; write policy {args.write_policy}; host pool "
        f"{args.hicache_ratio:g}x (disk modes {args.disk_host_ratio:g}x); modes {args.modes}",
        flush=True,
    )
    storage_dir = args.storage_dir or tempfile.mkdtemp(prefix="radixlm-multiturn-")
    folder = Path(storage_dir)
    if "disk" in args.modes and folder.is_dir() and any(folder.iterdir()):
        print(f"note: {storage_dir} is not empty: the disk mode starts warm from it")
    try:
        runs = [run_mode(args, mode, workload, storage_dir) for mode in args.modes]
    finally:
        if not args.storage_dir:
            shutil.rmtree(storage_dir, ignore_errors=True)
    print_rounds(runs, workload.num_rounds)
    print_throughput(runs)
    print_hits(runs, workload, args.page_size)
    print_ratios(runs, workload, args.page_size)
    print_outputs_check(runs)
    if args.plot:
        ok = [r for r in runs if not r.error]
        ttft = {r.mode: [r.ttft({k}) for k in range(workload.num_rounds)] for r in ok}
        hits = {r.mode: r.queried_split() for r in ok if r.tiers}
        written = plot_ttft_per_round(ttft, args.plot, hits or None)
        print(f"plot: {written}" if written else "no plot: matplotlib is not installed")
    failed = [r.mode for r in runs if r.error]
    if failed:
        raise SystemExit(f"modes failed: {failed} (tracebacks above)")


if __name__ == "__main__":
    main()
