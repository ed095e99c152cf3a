"""Frontend programs with the radix cache on and off: throughput and cache hit rate.

    python -m radixlm.srt.bench.bench_lang_programs                # default model, small sizes
    python -m radixlm.srt.bench.bench_lang_programs --num-questions 64 --workloads mc,fork

Three workloads in the style of the SGLang paper, written with radixlm.lang and run with
``run_batch``: few-shot multiple choice (a shared 5-shot prefix, then ``select`` over four
options), multi-turn chat (conversations that grow turn by turn under a shared system prompt)
and fork-heavy reasoning (a question, ``fork`` into several approaches, join, a final answer).
Each runs on an Engine with the radix cache, then on one without it (one Engine at a time, the
same greedy programs). The cache hit rate is sum(cached_tokens) / sum(prompt_tokens) over every
request the programs sent, from the server's meta_info. Without the cache the frontend skips
its prefill-only prefix requests, as they would only cost time.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import radixlm.lang as rl

GREEDY = {"temperature": 0.0}
SHOT_COUNT = 5


# ---------------------------------------------------------------------- programs
def arithmetic_question(rng: random.Random) -> tuple[str, list[str], str]:
    a, b = rng.randint(2, 49), rng.randint(2, 49)
    answer = a + b
    options = {answer}
    while len(options) < 4:
        options.add(answer + rng.choice([-10, -2, -1, 1, 2, 10]))
    shuffled = sorted(options, key=lambda _: rng.random())
    return f"What is {a} plus {b}?", [str(o) for o in shuffled], str(answer)


def mc_prefix(rng: random.Random) -> str:
    shots = [arithmetic_question(rng) for _ in range(SHOT_COUNT)]
    lines = ["Answer each question with one of its options.\n"]
    for question, options, answer in shots:
        lines.append(f"Question: {question}\nOptions: {', '.join(options)}\nAnswer: {answer}\n")
    return "\n".join(lines) + "\n"


@rl.function
def multiple_choice(s, prefix: str, question: str, options: list[str]):
    s += prefix + f"Question: {question}\nOptions: {', '.join(options)}\nAnswer:"
    s += rl.select("answer", [" " + o for o in options])


CHAT_SYSTEM = (
    "You are a patient tutor. You explain ideas with short, concrete sentences, give "
    "one everyday example when it helps, and never use lists or headings."
)
TOPICS = ["rain", "volcanoes", "bread", "magnets", "bicycles", "the moon", "bees", "rivers"]
FOLLOW_UPS = [
    "Tell me one fact about {t}.",
    "Why does that happen?",
    "Give an example.",
    "What else should I know?",
    "Summarize that in one sentence.",
]


@rl.function
def multi_turn_chat(s, topic: str, num_turns: int, max_tokens: int):
    s += rl.system(CHAT_SYSTEM)
    for turn in range(num_turns):
        s += rl.user(FOLLOW_UPS[turn % len(FOLLOW_UPS)].format(t=topic))
        s += rl.assistant(rl.gen(f"reply_{turn}", max_tokens=max_tokens))


@rl.function
def fork_reasoning(s, question: str, num_branches: int, max_tokens: int):
    s += (
        "Solve the problem. First think about it in several independent ways, then give the "
        f"final answer.\nProblem: {question}\n"
    )
    forks = s.fork(num_branches)
    for i, f in enumerate(forks):
        f += f"Approach {i + 1}:" + rl.gen("thought", max_tokens=max_tokens, stop="\n")
    forks.join()
    for i, thought in enumerate(s["thought"]):
        s += f"Approach {i + 1}:{thought}\n"
    s += "Final answer:" + rl.gen("answer", max_tokens=8, stop="\n")


# ---------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    name: str
    program: rl.Program
    batch: list[dict[str, Any]]
    score: Callable[[list[rl.ProgramState]], str] | None = None


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    rng = random.Random(args.seed)
    prefix = mc_prefix(rng)
    questions = [arithmetic_question(rng) for _ in range(args.num_questions)]
    truths = [q[2] for q in questions]

    def accuracy(states: list[rl.ProgramState]) -> str:
        right = sum(s["answer"].strip() == t for s, t in zip(states, truths, strict=True))
        return f"accuracy {right}/{len(truths)}"

    all_workloads = {
        "mc": Workload(
            "few-shot MC",
            multiple_choice,
            [{"prefix": prefix, "question": q, "options": o} for q, o, _ in questions],
            accuracy,
        ),
        "chat": Workload(
            "multi-turn chat",
            multi_turn_chat,
            [
                {
                    "topic": TOPICS[i % len(TOPICS)],
                    "num_turns": args.num_turns,
                    "max_tokens": args.max_tokens,
                }
                for i in range(args.num_conversations)
            ],
        ),
        "fork": Workload(
            "fork reasoning",
            fork_reasoning,
            [
                {
                    "question": arithmetic_question(rng)[0],
                    "num_branches": args.num_branches,
                    "max_tokens": args.max_tokens,
                }
                for _ in range(args.num_programs)
            ],
        ),
    }
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(names) - set(all_workloads))
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {sorted(all_workloads)}")
    return [all_workloads[n] for n in names]


# ---------------------------------------------------------------------- measuring
@dataclass(frozen=True)
class Result:
    workload: str
    cache: str
    num_programs: int
    seconds: float
    usage: rl.Usage
    note: str = ""

    @property
    def programs_per_s(self) -> float:
        return self.num_programs / self.seconds if self.seconds else 0.0


def run_workload(backend: rl.LocalBackend, w: Workload, cache: str, num_threads: Any) -> Result:
    backend.flush_cache()
    backend.usage.reset()
    start = time.perf_counter()
    states = w.program.run_batch(w.batch, backend=backend, num_threads=num_threads, **GREEDY)
    seconds = time.perf_counter() - start
    failed = [s.error() for s in states if s.error() is not None]
    if failed:
        raise SystemExit(f"{w.name}: {len(failed)} program(s) failed, first: {failed[0]}")
    note = w.score(states) if w.score else ""
    return Result(w.name, cache, len(states), seconds, backend.usage.snapshot(), note)


def run_mode(args: argparse.Namespace, workloads: list[Workload], cache_on: bool) -> list[Result]:
    backend = rl.Runtime(
        args.model_path,
        log_level="warning",
        max_total_tokens=args.max_total_tokens,
        disable_radix_cache=not cache_on,
    )
    try:
        warm = rl.function(lambda s: s.__iadd__("Hello" + rl.gen("w", max_tokens=4)))
        warm.run(backend=backend, **GREEDY)
        label = "on" if cache_on else "off"
        return [run_workload(backend, w, label, args.num_threads) for w in workloads]
    finally:
        backend.shutdown()


def print_table(results: list[Result]) -> None:
    header = (
        f"{'workload':16s} {'cache':5s} {'programs':>8s} {'requests':>8s} {'time s':>7s} "
        f"{'prog/s':>7s} {'prompt tok':>10s} {'cached tok':>10s} {'hit rate':>8s} "
        f"{'gen tok':>7s}  note"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        u = r.usage
        print(
            f"{r.workload:16s} {r.cache:5s} {r.num_programs:8d} {u.num_requests:8d} "
            f"{r.seconds:7.2f} {r.programs_per_s:7.2f} {u.prompt_tokens:10d} "
            f"{u.cached_tokens:10d} {u.cache_hit_rate:8.1%} {u.completion_tokens:7d}  {r.note}"
        )
    by_key = {(r.workload, r.cache): r for r in results}
    for name in dict.fromkeys(r.workload for r in results):
        on, off = by_key.get((name, "on")), by_key.get((name, "off"))
        if on and off and on.seconds:
            print(f"{name}: {off.seconds / on.seconds:.2f}x programs/s with the radix cache")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool size")
    p.add_argument("--workloads", default="mc,chat,fork", help="comma list of mc, chat, fork")
    p.add_argument("--cache", default="on,off", help="comma list of on, off")
    p.add_argument("--num-questions", type=int, default=12, help="mc: questions")
    p.add_argument("--num-conversations", type=int, default=4, help="chat: conversations")
    p.add_argument("--num-turns", type=int, default=3, help="chat: turns per conversation")
    p.add_argument("--num-programs", type=int, default=4, help="fork: programs")
    p.add_argument("--num-branches", type=int, default=3, help="fork: branches per program")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per chat reply / thought")
    p.add_argument("--num-threads", default="auto", help="run_batch threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.num_threads != "auto":
        args.num_threads = int(args.num_threads)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workloads = build_workloads(args)
    modes = [m.strip() for m in args.cache.split(",") if m.strip()]
    if not modes or set(modes) - {"on", "off"}:
        raise SystemExit(f"--cache takes on and/or off, got {args.cache!r}")
    results: list[Result] = []
    for mode in modes:
        results += run_mode(args, workloads, cache_on=mode == "on")
    results.sort(key=lambda r: ([w.name for w in workloads].index(r.workload), r.cache != "on"))
    print_table(results)


if __name__ == "__main__":
    main()
