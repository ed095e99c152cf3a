"""Constrained decoding cost: constrained vs unconstrained decode throughput side by side, and
the decode steps jump-forward saves on a JSON workload.

    python -m radixlm.srt.bench.bench_constrained                  # the default model, CPU
    python -m radixlm.srt.bench.bench_constrained --repeats 3 --max-new-tokens 96

Throughput: each workload runs its requests as one batch under its constraint (greedy,
jump-forward off, so every token is sampled), then the same prompts without a constraint, each
request decoding exactly as many tokens as its constrained twin (EOS ignored). Both sides do the
same forward work; the difference is the grammar: mask filling, masking, token acceptance. Runs
alternate, the best of ``--repeats`` counts, and the prefix cache is flushed before each run.
A warm-up run compiles the grammars first (their mask rows are memoized from then on).

Jump-forward: the JSON workload one request at a time with jump-forward off and on: forward
steps, output tokens, steps saved and whether the documents are the same.
"""

from __future__ import annotations

import argparse
import json
import time

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "occupation": {"type": "string", "maxLength": 24},
        "is_student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "occupation", "is_student"],
    "additionalProperties": False,
}
JSON_QUESTIONS = [
    "Give me a JSON object describing a person.",
    "Describe Marie Curie as a JSON object.",
    "Make up a user profile in JSON.",
    "Describe a famous painter as JSON.",
    "Invent a character for a novel and describe them in JSON.",
    "Describe a software engineer from Berlin as a JSON object.",
    "Return a JSON record for a student named Ana.",
    "Describe your favourite athlete as a JSON object.",
]
STORY_TOPICS = [
    "a lighthouse",
    "a lost key",
    "the first snow",
    "a clever fox",
    "an old train",
    "a quiet library",
    "a storm at sea",
    "a garden robot",
]


def timed_generate(engine, prompts: list[list[int]], params: list[dict]) -> tuple[float, list]:
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, outs


def chat_ids(engine, questions: list[str]) -> list[list[int]]:
    texts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    return [engine.tokenizer.encode(t) for t in texts]


def workloads(engine, batch_size: int) -> dict[str, tuple[list[list[int]], dict]]:
    questions = (JSON_QUESTIONS * batch_size)[:batch_size]
    prose = [f"Write a short story about {w}." for w in STORY_TOPICS]
    return {
        "json_schema (person record)": (
            chat_ids(engine, questions),
            {"json_schema": json.dumps(PERSON)},
        ),
        "json_object (any object)": (
            chat_ids(engine, questions),
            {"json_schema": '{"type": "object"}'},
        ),
        "regex (letters and punctuation)": (
            chat_ids(engine, (prose * batch_size)[:batch_size]),
            {"regex": r"[A-Za-z ,.;:'!?\n-]+"},
        ),
    }


def throughput_table(engine, max_new_tokens: int, batch_size: int, repeats: int) -> None:
    print(
        f"\n| workload ({batch_size} requests, one batch) | tokens | constrained tok/s "
        "| unconstrained tok/s | constrained slower by |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, (prompts, grammar) in workloads(engine, batch_size).items():
        constrained = [{"temperature": 0, "max_new_tokens": max_new_tokens, **grammar}] * len(
            prompts
        )
        _, outs = timed_generate(engine, prompts, constrained)  # warm-up: compile, memoize
        lengths = [o["meta_info"]["completion_tokens"] for o in outs]
        free = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            for side, params in enumerate((constrained, free)):
                elapsed, outs = timed_generate(engine, prompts, params)
                assert [o["meta_info"]["completion_tokens"] for o in outs] == lengths, name
                best[side] = min(best[side], elapsed)
        n = sum(lengths)
        print(
            f"| {name} | {n} | {n / best[0]:.1f} | {n / best[1]:.1f} "
            f"| {100 * (best[0] / best[1] - 1):+.1f}% |"
        )


def jump_forward_table(engine, max_new_tokens: int) -> None:
    ids = chat_ids(engine, JSON_QUESTIONS)
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "json_schema": json.dumps(PERSON)}
    grammars = engine.scheduler.grammars
    rows = {}
    for enabled in (False, True):
        grammars.jump_forward_enabled = enabled
        steps = tokens = 0
        docs, stopped, elapsed = [], 0, 0.0
        for one in ids:  # one request at a time: forward steps belong to it alone
            before = engine.scheduler.num_forward_steps
            t, (out,) = timed_generate(engine, [one], [params])
            elapsed += t
            steps += engine.scheduler.num_forward_steps - before
            tokens += out["meta_info"]["completion_tokens"]
            stopped += out["meta_info"]["finish_reason"]["type"] == "stop"
            docs.append(out["text"])
        rows[enabled] = (steps, tokens, stopped, elapsed, docs)
    grammars.jump_forward_enabled = not engine.config.disable_jump_forward
    same = sum(_same_json(a, b) for a, b in zip(rows[False][4], rows[True][4], strict=True))
    print(
        f"\n| JSON workload ({len(ids)} requests, one at a time) | forward steps | output tokens "
        "| finished (stop) | seconds |"
    )
    print("|---|---:|---:|---:|---:|")
    for enabled, (steps, tokens, stopped, elapsed, _) in rows.items():
        label = "jump-forward on" if enabled else "jump-forward off"
        print(f"| {label} | {steps} | {tokens} | {stopped}/{len(ids)} | {elapsed:.1f} |")
    saved = rows[False][0] - rows[True][0]
    print(
        f"\ndecode steps saved by jump-forward: {saved} of {rows[False][0]} "
        f"({100 * saved / max(rows[False][0], 1):.0f}%); identical documents: {same}/{len(ids)}"
    )


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct"
    )
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell (best is reported)")
    ap.add_argument(
        "--grammar-whitespace-pattern",
        default=None,
        help="JSON whitespace between tokens ('' for compact JSON)",
    )
    args = ap.parse_args(argv)

    import torch

    from radixlm.srt import Engine

    engine = Engine(
        model_path=args.model_path,
        log_level="warning",
        max_total_tokens=32768,
        grammar_whitespace_pattern=args.grammar_whitespace_pattern,
    )
    try:
        print(
            f"model {engine.scheduler.runner.model_dir}, {torch.get_num_threads()} threads, "
            f"grammar backend {engine.config.grammar_backend}"
        )
        engine.scheduler.grammars.jump_forward_enabled = False
        throughput_table(engine, args.max_new_tokens, args.batch_size, args.repeats)
        jump_forward_table(engine, args.max_new_tokens)
        info = engine.scheduler.grammars.info()
        print(
            f"\nmask fill: {info['mask_fill_us_per_row']:.1f} us per constrained row on average "
            f"({info['num_mask_rows']} rows)"
        )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
