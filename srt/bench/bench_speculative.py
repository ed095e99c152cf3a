"""Speculative decoding: decode speed with drafts off, n-gram drafts and a draft model.

    python -m radixlm.srt.bench.bench_speculative                    # default model: off, ngram
    python -m radixlm.srt.bench.bench_speculative --draft-model-path PATH   # + draft model
    python -m radixlm.srt.bench.bench_speculative --batch-sizes 1 --output-len 128

Two workloads of real text (embedded, nothing is downloaded), sent through the chat template:
``copy`` (rewrite a JSON record, convert one to YAML, quote sentences of a passage, edit a code
snippet: the answer repeats much of the prompt) and ``free`` (open-ended writing). Each runs at
batch 1 (the prompts one after another) and batch N (``--batch-sizes``), once per mode, each
mode in its own Engine. Decode tok/s is measured as (tokens of a full run - tokens of a
one-token run) / (time of the full run - time of the one-token run), so prefill is left out.
The acceptance rate is accepted / proposed draft tokens, the mean accepted length is accepted
draft tokens per verified draft (each verify adds the target's own token on top). Greedy
decoding by default: outputs should then be the same in every mode ("same" counts the
requests whose text equals the run without drafts; bf16 kernels may differ in rare ties).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

RECORDS = [
    {"id": 4812, "name": "Amelia Hart", "email": "amelia.hart@example.com", "city": "Leeds",
     "plan": "premium", "status": "active", "joined": "2021-03-14", "orders": 37,
     "tags": ["newsletter", "early-adopter"], "notes": "Prefers delivery after 6 pm."},
    {"id": 977, "name": "Rafael Costa", "email": "r.costa@example.org", "city": "Porto",
     "plan": "basic", "status": "suspended", "joined": "2019-11-02", "orders": 4,
     "tags": ["chargeback"], "notes": "Card declined twice in May; contact before shipping."},
    {"id": 15003, "name": "Mei Tanaka", "email": "mei.tanaka@example.net", "city": "Osaka",
     "plan": "enterprise", "status": "active", "joined": "2023-07-30", "orders": 212,
     "tags": ["bulk", "invoice", "priority"], "notes": "Invoices go to the finance team."},
    {"id": 3321, "name": "Jonas Berg", "email": "jonas.berg@example.com", "city": "Uppsala",
     "plan": "premium", "status": "trial", "joined": "2024-01-09", "orders": 1,
     "tags": [], "notes": "Asked about the student discount on the phone."},
]  # fmt: skip

PASSAGES = [
    "The bridge over the Tyne was opened on 11 October 1928 by King George V. It took three "
    "years to build and used about 7,000 tonnes of steel. At the time its arch was the longest "
    "in the world. Local people still call it the new bridge, although two others have been "
    "built since. A walkway on the east side is used by roughly 5,000 people every day.",
    "Our team met on Tuesday to review the launch plan. Marketing asked for two more weeks, "
    "which would move the release to 3 June. Engineering said the migration scripts are ready "
    "and that 94 percent of the tests pass. Support wants the help pages translated first. "
    "We agreed to decide on Friday after the security review.",
    "Honeybees visit around 2 million flowers to make one pound of honey. A worker bee lives "
    "for about six weeks in summer, but bees born in autumn can survive the whole winter. The "
    "queen may lay 1,500 eggs a day in spring. Bees tell each other where food is with a "
    "waggle dance whose angle points toward the sun.",
    "The library will close for repairs from 1 August to 15 September. During that time books "
    "can be returned at the town hall, which is open from 9 am to 5 pm. Fines will not be "
    "charged for those six weeks. The reading room reopens first, on 2 September, with 40 new "
    "desks and faster wifi.",
]

SNIPPETS = [
    ("mean", "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
     "    if len(values) == 0:\n        return 0\n    return total / len(values)\n",
     "average"),
    ("load_users", "def load_users(path):\n    users = []\n    with open(path) as f:\n"
     "        for line in f:\n            name, age = line.strip().split(',')\n"
     "            users.append({'name': name, 'age': int(age)})\n    return users\n",
     "read_users"),
    ("is_prime", "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n"
     "    while i * i <= n:\n        if n % i == 0:\n            return False\n"
     "        i += 1\n    return True\n", "check_prime"),
    ("word_counts", "def word_counts(text):\n    counts = {}\n    for word in text.split():\n"
     "        word = word.lower().strip('.,!?')\n        counts[word] = counts.get(word, 0) + 1\n"
     "    return counts\n", "count_words"),
]  # fmt: skip

FREE_TOPICS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old why the sky is blue.",
    "Describe a busy market in a city you imagine, using all five senses.",
    "Give advice to someone starting their first job as a software engineer.",
    "Write a letter from a cat to its owner about the new dog in the house.",
    "What are the pros and cons of working from home? Discuss both sides.",
    "Invent a new sport and explain its rules.",
    "Write a poem about autumn rain in a big city.",
    "Describe how bread is made, from the field to the table.",
    "Tell the story of a robot that learns to paint.",
    "Explain how a bicycle stays upright while moving.",
    "Plan a three-day trip to the mountains for a family with two children.",
    "Write a dialogue between a chess player and the chess board.",
    "Why do people enjoy listening to sad music? Give a few reasons.",
    "Describe the first day of a colony on Mars.",
    "Write a recipe for a soup that a child could help make, with tips.",
]


def copy_tasks() -> list[str]:
    tasks = []
    for record in RECORDS:
        text = json.dumps(record, indent=2)
        tasks.append(
            f'Here is a JSON record:\n{text}\nRewrite it with the field "status" set to '
            '"archived" and every other field unchanged. Output only the JSON.'
        )
    for passage in PASSAGES:
        tasks.append(
            f"{passage}\n\nQuote, word for word, every sentence of the text above that "
            "contains a number or a date, one per line."
        )
    for old, code, new in SNIPPETS:
        tasks.append(
            f"```python\n{code}```\nRename the function `{old}` to `{new}`, keep everything "
            "else the same, and output the complete code."
        )
    for record in RECORDS:
        tasks.append(f"Convert this JSON record to YAML:\n{json.dumps(record, indent=2)}")
    return tasks


WORKLOADS = {"copy": copy_tasks, "free": lambda: list(FREE_TOPICS)}


def chat_prompts(tokenizer, tasks: list[str]) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        for t in tasks
    ]


def run(engine, prompts: list[str], batch: int, max_new: int, temperature: float):
    """(seconds, output tokens, texts) of the prompts in groups of ``batch``, cache flushed
    first (no continuation of an earlier run can be drafted from the prefix cache)."""
    engine.flush_cache()
    params = {"temperature": temperature, "max_new_tokens": max_new}
    if temperature > 0:
        params["sampling_seed"] = 1234
    seconds, tokens, texts = 0.0, 0, []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        start = time.perf_counter()
        outs = engine.generate(prompt=group, sampling_params=params)
        seconds += time.perf_counter() - start
        tokens += sum(o["meta_info"]["completion_tokens"] for o in outs)
        texts += [o["text"] for o in outs]
    return seconds, tokens, texts


def drafter_counts(engine) -> tuple[float, float, float]:
    """(proposed, accepted, verified) draft totals so far; zeros without speculation."""
    stats = engine.get_server_info().get("speculative", {}).get("drafter", {})
    return tuple(float(stats.get(k, 0.0)) for k in ("num_proposed", "num_accepted", "num_verified"))


def measure(engine, prompts, batch, args) -> dict:
    first_s, first_tok, _ = run(engine, prompts, batch, 1, args.temperature)
    before = drafter_counts(engine)
    full_s, full_tok, texts = run(engine, prompts, batch, args.output_len, args.temperature)
    proposed, accepted, verified = (
        a - b for a, b in zip(drafter_counts(engine), before, strict=True)
    )
    return {
        "decode_tps": (full_tok - first_tok) / max(full_s - first_s, 1e-9),
        "acceptance": accepted / proposed if proposed else float("nan"),
        "mean_accepted": accepted / verified if verified else float("nan"),
        "texts": texts,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--draft-model-path", default=None, help="adds the draft-model mode")
    ap.add_argument("--batch-sizes", default="1,16", help="comma list")
    ap.add_argument("--workloads", default="copy,free", help="comma list of copy, free")
    ap.add_argument("--output-len", type=int, default=256, help="max new tokens per request")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts timed at batch 1")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.workloads = args.workloads.split(",")
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown --workloads {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    return args


def modes(args: argparse.Namespace) -> dict[str, dict]:
    out = {"off": {}, "ngram": {"speculative_algorithm": "ngram"}}
    if args.draft_model_path:
        out["draft"] = {
            "speculative_algorithm": "draft",
            "speculative_draft_model_path": args.draft_model_path,
        }
    for options in out.values():
        if options:
            options["speculative_num_draft_tokens"] = args.num_draft_tokens
    return out


def cells(tokenizer, args) -> list[tuple[str, int, list[str]]]:
    """(workload, batch size, prompts) of every measured cell."""
    out = []
    for name in args.workloads:
        prompts = chat_prompts(tokenizer, WORKLOADS[name]())
        for batch in args.batch_sizes:
            chosen = prompts[: args.batch1_prompts] if batch == 1 else (prompts * batch)[:batch]
            out.append((name, batch, chosen))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from radixlm.srt import Engine

    results: dict[tuple[str, int, str], dict] = {}
    label = ""
    for mode, options in modes(args).items():
        engine = Engine(
            model_path=args.model_path,
            log_level="warning",
            max_total_tokens=args.max_total_tokens,
            dtype=args.dtype,
            device=args.device,
            disable_cuda_graph=args.disable_cuda_graph,
            **options,
        )
        label = f"{engine.scheduler.runner.model_dir} on {engine.scheduler.runner.device}"
        run(engine, chat_prompts(engine.tokenizer, ["Say hello."]), 1, 8, 0.0)  # warm-up
        for name, batch, prompts in cells(engine.tokenizer, args):
            results[(name, batch, mode)] = measure(engine, prompts, batch, args)
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_table(results, args, label)


def print_table(results: dict, args: argparse.Namespace, label: str) -> None:
    print(
        f"model {label}, {args.num_draft_tokens} draft tokens, temperature {args.temperature}, "
        f"up to {args.output_len} new tokens"
    )
    print(
        f"{'workload':<10}{'batch':>6}{'mode':>7}{'decode tok/s':>14}{'accept':>8}"
        f"{'mean acc':>10}{'speed-up':>10}{'same':>8}"
    )
    for (name, batch, mode), r in results.items():
        base = results[(name, batch, "off")]
        same = sum(a == b for a, b in zip(r["texts"], base["texts"], strict=True))
        accept, mean = (_ratio(r["acceptance"]), _ratio(r["mean_accepted"]))
        print(
            f"{name:<10}{batch:>6}{mode:>7}{r['decode_tps']:>14.1f}{accept:>8}{mean:>10}"
            f"{r['decode_tps'] / base['decode_tps']:>9.2f}x{same:>5}/{len(r['texts'])}"
        )


def _ratio(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"  # NaN: no drafts in this mode


if __name__ == "__main__":
    main()
