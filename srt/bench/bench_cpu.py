"""CPU speed side by side: radixlm and llama.cpp on the same GGUF and token ids, in one run.

    python -m radixlm.srt.bench.bench_cpu                    # the default model's Q4_1 GGUF
    python -m radixlm.srt.bench.bench_cpu --threads 1 --rounds 5
    python -m radixlm.srt.bench.bench_cpu --kernels both     # radixlm's CPU kernels on and off
    python -m radixlm.srt.bench.bench_cpu --step both        # int4 decode in one call or by layer
    python -m radixlm.srt.bench.bench_cpu --against REV      # int4 also with REV's GEMV kernels
    python -m radixlm.srt.bench.bench_cpu --int4-rows 16     # int4 decode batches > 16 rows dense

Contenders: radixlm for each ``--quantization`` mode (int4: the GGUF's own Q4_1 codes), with
its C++ CPU kernels (``kernels/cpu_decode.py``, ``kernels/gguf_cpu.py``) on, off (the torch
paths) or both, int4 decode steps in one C++ call (``kernels/cpu_step.py``) or layer by
layer (``--step``), and
llama.cpp through llama-cpp-python (``pip install llama-cpp-python``; an optional benchmark
dependency: without it, or with a model that is not a GGUF file, radixlm runs alone and the
ratios are against the first contender). Every contender gets the same token ids, the same
thread count, and decodes ``--output-len`` tokens greedily per request, EOS ignored.

Workloads: ``1`` (one 128-token prompt), ``batch`` (``--batch-size`` prompts of 32-512 tokens;
llama.cpp runs them one after another through its high-level API and, as "llama.cpp batched",
all together through its batch API: ``llama_cpp_batched.py``), ``prefill`` (one 512-token
prompt, one token out). Rounds alternate the contenders' order (the machine may be shared: each
round sees the same background load on every side); the table gives medians over the rounds:
output tok/s (prefill included), decode ms per step (the full run less a one-token run, per
later token) and the ratio of tok/s to llama.cpp's. The CPU model is printed first.

``--server`` adds, for each radixlm mode, the same engine options served by ``radixlm serve``
(a real ZMQ trio on 127.0.0.1) and driven over HTTP: each run is one native ``/generate`` with
the workload's token ids (a batch for several prompts). A last table gives what the server adds
to the in-process engine: per request (its one-token runs, prefill included) and per decode step.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixlm.srt.bench.bench_offline import make_prompts


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), its core count and torch's vector ISA."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    from radixlm.kernels import gguf_cpu

    isa = torch.backends.cpu.get_cpu_capability()
    gemv = gguf_cpu.isa() or "not built"
    return (
        f"{name}, {torch.get_num_threads()} threads of {_cores()} cores, torch ISA {isa}, "
        f"radixlm GEMV {gemv}"
    )


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@dataclass
class Contender:
    name: str
    run: Callable[[list[list[int]], int], float]  # (prompts, tokens each) -> seconds
    ids: Callable[[list[int], int], list[int]]  # greedy ids of one prompt
    times: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def generate_contender(
    name: str, generate: Callable[[list[list[int]], int], list[dict]]
) -> Contender:
    """A contender over ``generate(prompts, n)``, which returns radixlm's output dicts."""

    def run(prompts: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        outs = generate(prompts, n)
        elapsed = time.perf_counter() - start
        assert all(o["meta_info"]["completion_tokens"] == n for o in outs)
        return elapsed

    def ids(prompt: list[int], n: int) -> list[int]:
        return list(generate([prompt], n)[0]["output_ids"])

    return Contender(name, run, ids)


def radixlm_contender(
    engine, name: str, kernels: bool, step: bool = True, gemv_lib=None, rows: int | None = None
) -> Contender:
    """``kernels`` False: every C++ CPU kernel off (the torch paths); ``step`` False: int4
    decode layer by layer instead of the one-call step; ``gemv_lib``: another build of the
    GGUF GEMVs (``bench_gguf_cpu.library_at``) in place of this tree's; ``rows``: the int4
    kernels' row limit for decode batches (``gguf_cpu.rows_limit``) instead of theirs."""
    from radixlm.kernels import cpu_decode, cpu_step, gguf_cpu

    def scope():
        stack = contextlib.ExitStack()
        if gemv_lib is not None:
            stack.enter_context(gguf_cpu.library_override(gemv_lib))
        if rows is not None:
            stack.enter_context(gguf_cpu.rows_limit(rows))
        if not kernels:
            stack.enter_context(cpu_decode.disabled())
            stack.enter_context(gguf_cpu.disabled())
        if not step:
            stack.enter_context(cpu_step.disabled())
        return stack

    def generate(prompts: list[list[int]], n: int) -> list[dict]:
        params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        engine.flush_cache()  # no prefix reuse between runs: every run prefills its prompts
        with scope():
            outs = engine.generate(input_ids=prompts, sampling_params=params)
        return outs if isinstance(outs, list) else [outs]

    return generate_contender(name, generate)


def server_contender(url: str, name: str) -> Contender:
    """A ``radixlm serve`` at ``url`` through native ``/generate`` (the workload's prompts as
    one batch), its prefix cache flushed before every run as the engine's is."""
    import httpx

    client = httpx.Client(timeout=600)

    def generate(prompts: list[list[int]], n: int) -> list[dict]:
        client.post(url + "/flush_cache").raise_for_status()
        params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        r = client.post(url + "/generate", json={"input_ids": prompts, "sampling_params": params})
        r.raise_for_status()
        outs = r.json()
        return outs if isinstance(outs, list) else [outs]

    return generate_contender(name, generate)


def llama_cpp_contender(gguf: Path, threads: int, n_ctx: int, flash_attn: bool) -> Contender:
    """llama.cpp on the GGUF; ImportError without llama-cpp-python."""
    import llama_cpp

    kwargs = dict(n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads)
    try:
        llm = llama_cpp.Llama(str(gguf), verbose=False, flash_attn=flash_attn, **kwargs)
    except TypeError:  # a version without the flash_attn argument
        llm = llama_cpp.Llama(str(gguf), verbose=False, **kwargs)

    def one(prompt: list[int], n: int) -> list[int]:
        llm.reset()  # no prefix reuse: every run prefills
        out = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return out

    def run(prompts: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        for p in prompts:
            one(p, n)
        return time.perf_counter() - start

    name = f"llama.cpp {getattr(llama_cpp, '__version__', '')}".strip()
    return Contender(name, run, one)


def llama_cpp_batched_contender(
    gguf: Path, threads: int, ctx_per_seq: int, max_seqs: int, flash_attn: bool
) -> Contender:
    """llama.cpp decoding a workload's prompts together (its low-level batch API, one sequence
    per request); ImportError without llama-cpp-python."""
    from radixlm.srt.bench.llama_cpp_batched import open_batched

    llm = open_batched(gguf, max_seqs, ctx_per_seq, threads, flash_attn)

    def run(prompts: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, n)
        return time.perf_counter() - start

    return Contender("llama.cpp batched", run, lambda prompt, n: llm.generate([prompt], n)[0])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--threads", type=int, default=None, help="default: torch's (all cores)")
    ap.add_argument("--quantization", default="int4,none", help="radixlm modes, comma list")
    ap.add_argument("--kernels", choices=["on", "off", "both"], default="on")
    ap.add_argument(
        "--step", choices=["on", "off", "both"], default="on", help="int4 decode in one call"
    )
    ap.add_argument("--workloads", default="1,batch,prefill")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="radixlm alone")
    ap.add_argument("--server", action="store_true", help="also each radixlm mode served over HTTP")
    ap.add_argument(
        "--against",
        default=None,
        help="int4 also with the GGUF GEMVs of this git revision (float16 Q4_1 scales: b881c75 on)",
    )
    ap.add_argument(
        "--int4-rows",
        default=None,
        help="int4 also with the int4 kernels' decode row limit at these values (comma list; "
        "16 was the limit before 2026-12-08)",
    )
    ap.add_argument(
        "--llama-flash-attn", choices=["on", "off"], default="on", help="llama.cpp's attention"
    )
    ap.add_argument(
        "--llama-batched",
        choices=["on", "off"],
        default="on",
        help="also llama.cpp with a workload's prompts decoded together (its batch API)",
    )
    return ap.parse_args(argv)


def workloads(tok, args: argparse.Namespace) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (prompts, output tokens per request)."""
    chosen, out = args.workloads.split(","), {}
    if "1" in chosen:
        out["batch 1"] = (make_prompts(tok, 1, 128, 128), args.output_len)
    if "batch" in chosen:
        prompts = make_prompts(tok, args.batch_size, 32, 512)
        out[f"batch {args.batch_size}, mixed"] = (prompts, args.output_len)
    if "prefill" in chosen:
        out["prefill 512"] = (make_prompts(tok, 1, 512, 512), 1)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from radixlm.kernels import gguf_cpu
    from radixlm.srt import Engine
    from radixlm.srt.bench.bench_gguf_cpu import library_at
    from radixlm.srt.models.default_model import default_gguf_path

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    gguf = Path(args.model_path) if args.model_path else default_gguf_path()
    print(f"CPU: {cpu_model()}")
    print(f"model {gguf}, {args.output_len} output tokens/request, {args.rounds} rounds")
    contenders: list[Contender] = []
    engines = []
    try:
        int4_rows = [int(v) for v in args.int4_rows.split(",")] if args.int4_rows else []
    except ValueError:
        raise SystemExit(f"--int4-rows takes whole numbers, got {args.int4_rows!r}") from None
    if any(v < 1 for v in int4_rows):
        raise SystemExit("--int4-rows values must be at least 1")
    modes = {"on": [True], "off": [False], "both": [True, False]}
    servers = contextlib.ExitStack()
    for q in args.quantization.split(","):
        engine = Engine(
            model_path=str(gguf),
            log_level="warning",
            max_total_tokens=32768,
            quantization=q,
            num_threads=threads,
        )
        engines.append(engine)
        if args.server:
            from radixlm.srt.server.process.server_process import ServerProcess

            flags = ["--model-path", str(gguf), "--max-total-tokens", "32768"]
            flags += ["--quantization", q, "--num-threads", str(threads), "--log-level", "warning"]
            server = servers.enter_context(ServerProcess(flags))
            name = f"radixlm {'int4' if q == 'int4' else 'fp32'} server"
            contenders.append(server_contender(server.url, name))
        for on in modes[args.kernels]:
            steps = modes[args.step] if q == "int4" and on else [True]
            for step in steps:
                label = f"radixlm {'int4' if q == 'int4' else 'fp32'}"
                label += "" if args.kernels == "on" else (" kernels" if on else " torch ops")
                label += "" if len(steps) == 1 else (" step" if step else " layers")
                contenders.append(radixlm_contender(engine, label, on, step))
                for rows in int4_rows if q == "int4" and on else []:
                    contenders.append(
                        radixlm_contender(engine, f"{label} rows<={rows}", on, step, rows=rows)
                    )
                if args.against and q == "int4" and on:
                    lib = library_at(args.against)
                    if lib.q4_1_layout != gguf_cpu.Q4_1_LAYOUT:  # the engine's packed weights
                        raise SystemExit(f"{args.against}'s GEMVs take another Q4_1 layout")
                    label += f" @{args.against}"
                    contenders.append(radixlm_contender(engine, label, on, step, lib))
    tok = engines[0].tokenizer
    loads = workloads(tok, args)
    n_ctx = 512 + args.output_len + 16
    if not args.no_llama_cpp and gguf.suffix.lower() == ".gguf":
        try:
            flash = args.llama_flash_attn == "on"
            contenders.insert(0, llama_cpp_contender(gguf, threads, n_ctx, flash))
            if args.llama_batched == "on":
                max_seqs = max(len(prompts) for prompts, _ in loads.values())
                batched = llama_cpp_batched_contender(gguf, threads, n_ctx, max_seqs, flash)
                contenders.insert(1, batched)
        except ImportError:
            print("llama-cpp-python is not installed (pip install llama-cpp-python): radixlm only")
    same_ids_check(contenders, loads, args.output_len)
    for c in contenders:  # warm-up
        c.run(next(iter(loads.values()))[0][:1], 4)
    for r in range(args.rounds):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for name, (prompts, n) in loads.items():
            for c in order:
                full = c.run(prompts, n)
                first = c.run(prompts, 1) if n > 1 else full
                c.times.setdefault(name, []).append((full, first))
    report(contenders, loads)
    if args.server:
        server_overhead(contenders, loads)
    servers.close()
    for engine in engines:
        engine.shutdown()


def same_ids_check(contenders: list[Contender], loads, output_len: int) -> None:
    """Prints whether every contender's greedy ids for the first workload's prompt agree."""
    prompt = next(iter(loads.values()))[0][0]
    ids = {c.name: c.ids(prompt, output_len) for c in contenders}
    first = next(iter(ids.values()))
    for name, got in ids.items():
        same = sum(a == b for a, b in zip(got, first, strict=False))
        print(f"greedy ids of {name}: {same}/{len(first)} equal to {contenders[0].name}'s")


def report(contenders: list[Contender], loads) -> None:
    base = contenders[0]
    print(f"{'workload':<20}{'contender':<26}{'tok/s':>8}{'ms/step':>9}  vs {base.name}")
    for name, (prompts, n) in loads.items():
        tokens = len(prompts) * n if n > 1 else sum(len(p) for p in prompts)
        rate = {c.name: statistics.median(tokens / f for f, _ in c.times[name]) for c in contenders}
        for c in contenders:
            steps = [(f - s) / max(n - 1, 1) * 1e3 for f, s in c.times[name]]
            step = f"{statistics.median(steps):>9.2f}" if n > 1 else f"{'-':>9}"
            ratio = rate[c.name] / rate[base.name]
            print(f"{name:<20}{c.name:<26}{rate[c.name]:>8.1f}{step}{ratio:>8.2f}x")
    print("(prefill rows: prompt tokens/s; medians over the rounds; a shared machine is noisy)")


def server_overhead(contenders: list[Contender], loads) -> None:
    """What each server adds to its engine (the contender named as it, less " server"): per
    request (the one-token runs: a batch's requests together) and per decode step."""
    by_name = {c.name: c for c in contenders}
    print(f"{'workload':<20}{'server':<26}{'+ms/request':>12}{'+ms/step':>10}")
    for c in contenders:
        engine = by_name.get(c.name.removesuffix(" server"))
        if engine is None or engine is c:
            continue
        for name, (_, n) in loads.items():
            first = statistics.median(s for _, s in c.times[name]) * 1e3
            first -= statistics.median(s for _, s in engine.times[name]) * 1e3
            step = "-"
            if n > 1:
                per = [
                    statistics.median((f - s) / (n - 1) for f, s in x.times[name])
                    for x in (c, engine)
                ]
                step = f"{(per[0] - per[1]) * 1e3:.2f}"
            print(f"{name:<20}{c.name:<26}{first:>12.2f}{step:>10}")


if __name__ == "__main__":
    main()
