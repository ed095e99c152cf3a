"""JSONSchemaBench sample: compile coverage and time per grammar backend, mask time per token,
and the validity of generated documents, per subset and overall.

    python -m radixlm.srt.bench.bench_jsonschema                 # all 100 schemas
    python -m radixlm.srt.bench.bench_jsonschema --limit 2       # 2 schemas per subset
    python -m radixlm.srt.bench.bench_jsonschema --subsets Snowplow,WashingtonPost

Data: ``--data-dir`` (default ``../shared/data/jsonschemabench`` next to the repository), one
JSON file per schema (``schema`` plus test documents); the subset is the file name's prefix
before ``---``.

1. Compile coverage: every schema is compiled by ``outlines``, ``llguidance`` and ``auto`` (the
   server's default configuration: outlines-core within its 3 s budget, else llguidance, then
   lenient llguidance) in a forked child process that is killed at the limit, so an
   over-budget compilation cannot slow the next one. "<= 5 s" counts compilations that
   finished within ``--budget-s``; ``auto, any`` also counts auto compilations that finished
   later (limit 3x the budget).
2. Generation: SmolLM2 (greedy) writes one document per schema ``auto`` compiles, prompted with
   the (truncated) schema; a subset's requests go to the engine in one batch. Documents that
   finished with ``stop`` are validated with ``jsonschema`` (the validator of the schema's
   ``$schema`` draft) once the subset is done. Mask time per token is the time one request's
   mask row costs the scheduler thread in a constrained step (waiting for the row the worker
   thread prefetched during the forward pass and copying it, or filling it inline); "fill" is
   the time the filling itself took, wherever it ran.

   Earlier runs gave each request its own calling thread and validated each finished document
   there while the others were still decoding. That Python took the GIL from the scheduler
   thread, which gives it up in every torch op and every llguidance mask and may then wait a
   whole switch interval (5 ms) to get it back, so mask rows also measured the validation.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared/data/jsonschemabench"
BACKENDS = ("outlines", "llguidance", "auto")
PROMPT = (
    "Write one JSON document that is valid against the JSON schema below. Use realistic "
    "values and keep it short.\nSchema: {schema}"
)


@dataclass
class Case:
    subset: str
    name: str
    schema: Any  # dict, or a boolean schema

    @property
    def schema_text(self) -> str:
        return json.dumps(self.schema)


@dataclass
class CompileResult:
    ok: bool
    seconds: float
    error: str = ""


@dataclass
class Generated:
    finished: bool  # ended with stop (not length)
    valid: bool | None  # None: not finished, or the schema cannot be checked by jsonschema
    text: str = ""
    error: str = ""  # the engine's own compilation failed


@dataclass
class SubsetReport:
    cases: list[Case] = field(default_factory=list)
    compiles: dict[str, list[CompileResult]] = field(default_factory=dict)
    docs: list[Generated] = field(default_factory=list)
    mask_times_s: list[float] = field(default_factory=list)
    mask_compute_times_s: list[float] = field(default_factory=list)


def load_cases(data_dir: Path, limit: int | None, subsets: list[str] | None = None) -> list[Case]:
    files = sorted(data_dir.glob("*.json"))
    if not files:
        raise ValueError(f"no schema files in {data_dir}; pass --data-dir")
    per_subset: dict[str, int] = {}
    cases = []
    for path in files:
        subset = path.stem.split("---")[0]
        if subsets is not None and subset not in subsets:
            continue
        if limit is not None and per_subset.get(subset, 0) >= limit:
            continue
        per_subset[subset] = per_subset.get(subset, 0) + 1
        cases.append(Case(subset, path.stem, json.loads(path.read_text())["schema"]))
    return cases


# ---------------------------------------------------------------------- compile coverage
def _compile_child(backend, spec, conn) -> None:
    start = time.perf_counter()
    try:
        backend.compile(spec)
        conn.send((True, time.perf_counter() - start, ""))
    except Exception as e:  # reported to the parent as a failure
        conn.send((False, time.perf_counter() - start, str(e).splitlines()[0][:160]))


def timed_compile(backend, spec, limit_s: float) -> CompileResult:
    """Compiles ``spec`` in a forked child, killed after ``limit_s``."""
    ctx = mp.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_compile_child, args=(backend, spec, sender), daemon=True)
    start = time.perf_counter()
    child.start()
    try:
        if receiver.poll(limit_s):
            return CompileResult(*receiver.recv())
        return CompileResult(False, time.perf_counter() - start, f"over {limit_s:g} s")
    finally:
        child.kill()
        child.join()


def make_backends(tokenizer, eos_token_ids: list[int], vocab_size: int) -> dict:
    from radixlm.grammar import GrammarConfig, build_vocab, create_grammar_backend

    vocab = build_vocab(tokenizer, eos_token_ids, vocab_size)
    backends = {
        name: create_grammar_backend(GrammarConfig(backend=name), vocab) for name in BACKENDS
    }
    # Tokenizer tables are built once here, not in every child (a server builds them at start).
    backends["llguidance"].lltokenizer()
    backends["auto"].llguidance.lltokenizer()
    backends["outlines"].outlines_vocabulary()
    backends["auto"].outlines.outlines_vocabulary()
    return backends


def run_coverage(
    cases: list[Case], backends: dict, budget_s: float, reports: dict[str, SubsetReport]
) -> None:
    from radixlm.grammar import GrammarSpec

    for i, case in enumerate(cases):
        spec = GrammarSpec.json_schema(case.schema_text)
        line = []
        for name, backend in backends.items():
            limit = 3 * budget_s if name == "auto" else budget_s
            result = timed_compile(backend, spec, limit)
            reports[case.subset].compiles.setdefault(name, []).append(result)
            line.append(f"{name} {'ok' if result.ok else 'FAIL'} {result.seconds:.2f}s")
        print(f"  [{i + 1}/{len(cases)}] {case.name}: " + ", ".join(line), flush=True)


# ---------------------------------------------------------------------- generation
def validate(schema: Any, text: str) -> bool | None:
    import jsonschema

    try:
        doc = json.loads(text)
    except ValueError:
        return False
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        errors = list(validator.iter_errors(doc))
    except Exception:  # unresolvable $ref, invalid schema: jsonschema cannot judge
        return None
    return not errors


def _prompt(engine, case: Case, max_schema_chars: int) -> str:
    text = case.schema_text
    if len(text) > max_schema_chars:
        text = text[:max_schema_chars] + " ..."
    return engine.apply_chat_template([{"role": "user", "content": PROMPT.format(schema=text)}])


def _judge(case: Case, out: dict | ValueError) -> Generated:
    if isinstance(out, ValueError):  # the engine's own compilation failed
        return Generated(False, None, error=str(out).splitlines()[0][:160])
    finished = out["meta_info"]["finish_reason"]["type"] == "stop"
    return Generated(
        finished, validate(case.schema, out["text"]) if finished else None, out["text"]
    )


def _generate_or_error(engine, prompt: str, params: dict) -> dict | ValueError:
    try:
        return engine.generate(prompt, params)
    except ValueError as e:
        return e


def generate_subset(
    engine, cases: list[Case], max_new_tokens: int, max_schema_chars: int
) -> list[Generated]:
    """All documents of a subset in one batch (validated once it is done, so no other thread
    runs Python next to the scheduler); one by one if the engine fails to compile one."""
    if not cases:
        return []
    prompts = [_prompt(engine, c, max_schema_chars) for c in cases]
    params = [
        {"temperature": 0, "max_new_tokens": max_new_tokens, "json_schema": c.schema_text}
        for c in cases
    ]
    try:
        outs = engine.generate(prompts, params)
    except ValueError:
        print("  an engine-side compilation failed; generating one by one", flush=True)
        outs = [_generate_or_error(engine, p, q) for p, q in zip(prompts, params, strict=True)]
    return [_judge(c, out) for c, out in zip(cases, outs, strict=True)]


def run_generation(
    engine, reports: dict[str, SubsetReport], max_new_tokens: int, max_schema_chars: int
) -> None:
    grammars = engine.scheduler.grammars
    for subset, report in reports.items():
        chosen = [c for c, r in zip(report.cases, report.compiles["auto"], strict=True) if r.ok]
        grammars.mask_times_s, grammars.mask_compute_times_s = [], []
        start = time.perf_counter()
        report.docs = generate_subset(engine, chosen, max_new_tokens, max_schema_chars)
        report.mask_times_s, grammars.mask_times_s = grammars.mask_times_s, None
        report.mask_compute_times_s = grammars.mask_compute_times_s
        grammars.mask_compute_times_s = None
        print(
            f"  {subset}: {len(chosen)} documents in {time.perf_counter() - start:.0f} s",
            flush=True,
        )


# ---------------------------------------------------------------------- report
def _pct(values: list[float], q: float, scale: float = 1.0) -> str:
    return f"{np.percentile(values, q) * scale:.2f}" if values else "-"


def _share(num: int, den: int) -> str:
    return f"{100 * num / den:.0f}% ({num}/{den})" if den else "-"


def print_compile_table(reports: dict[str, SubsetReport], budget_s: float) -> None:
    print(
        f"\n| subset | schemas | outlines <= {budget_s:g} s | llguidance <= {budget_s:g} s "
        f"| auto <= {budget_s:g} s | auto, any | compile p50 / p90 s: outlines "
        "| llguidance | auto |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for subset, r in reports.items():
        cells = []
        for name in BACKENDS:
            within = sum(c.ok and c.seconds <= budget_s for c in r.compiles[name])
            cells.append(_share(within, len(r.cases)))
        cells.append(_share(sum(c.ok for c in r.compiles["auto"]), len(r.cases)))
        for name in BACKENDS:
            times = [c.seconds for c in r.compiles[name] if c.ok]
            cells.append(f"{_pct(times, 50)} / {_pct(times, 90)}")
        print(f"| {subset} | {len(r.cases)} | " + " | ".join(cells) + " |")


def print_generation_table(reports: dict[str, SubsetReport]) -> None:
    print(
        "\n| subset | documents | finished (stop) | valid / finished | not checkable "
        "| mask us/token p50 | p99 | fill us p50 | p99 | rows |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for subset, r in reports.items():
        finished = [d for d in r.docs if d.finished]
        checked = [d for d in finished if d.valid is not None]
        print(
            f"| {subset} | {len(r.docs)} | {_share(len(finished), len(r.docs))} "
            f"| {_share(sum(bool(d.valid) for d in checked), len(checked))} "
            f"| {len(finished) - len(checked)} | {_pct(r.mask_times_s, 50, 1e6)} "
            f"| {_pct(r.mask_times_s, 99, 1e6)} | {_pct(r.mask_compute_times_s, 50, 1e6)} "
            f"| {_pct(r.mask_compute_times_s, 99, 1e6)} | {len(r.mask_times_s)} |"
        )


def with_overall(reports: dict[str, SubsetReport]) -> dict[str, SubsetReport]:
    total = SubsetReport()
    for r in reports.values():
        total.cases += r.cases
        total.docs += r.docs
        total.mask_times_s += r.mask_times_s
        total.mask_compute_times_s += r.mask_compute_times_s
        for name, results in r.compiles.items():
            total.compiles.setdefault(name, []).extend(results)
    return {**reports, "**overall**": total}


def print_failures(reports: dict[str, SubsetReport]) -> None:
    print("\nauto failures and invalid documents:")
    for r in reports.values():
        for case, result in zip(r.cases, r.compiles.get("auto", []), strict=True):
            if not result.ok:
                print(f"  compile {case.name}: {result.error}")
        chosen = [c for c, res in zip(r.cases, r.compiles["auto"], strict=True) if res.ok]
        for case, doc in zip(chosen, r.docs, strict=True):
            if doc.error:
                print(f"  engine compile {case.name}: {doc.error}")
            if doc.valid is False:
                print(f"  invalid {case.name}: {doc.text[:160]!r}")


def print_unfinished(reports: dict[str, SubsetReport], chars: int = 240) -> None:
    """The end of each document that ran out of tokens: what the grammar let run long."""
    print("\nunfinished documents (last characters):")
    for r in reports.values():
        chosen = [c for c, res in zip(r.cases, r.compiles["auto"], strict=True) if res.ok]
        for case, doc in zip(chosen, r.docs, strict=True):
            if not doc.finished and not doc.error:
                print(f"  {case.name}: ...{doc.text[-chars:]!r}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    ap.add_argument("--limit", type=int, default=None, help="schemas per subset (default: all)")
    ap.add_argument(
        "--subsets",
        default=None,
        help="comma-separated subsets to run, e.g. Snowplow,WashingtonPost (default: all)",
    )
    ap.add_argument("--budget-s", type=float, default=5.0, help="compile time budget")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument(
        "--max-schema-chars",
        type=int,
        default=2000,
        help="schema text shown in the prompt (the constraint is the full schema)",
    )
    ap.add_argument("--skip-generation", action="store_true")
    ap.add_argument(
        "--skip-coverage",
        action="store_true",
        help="generation only: every schema goes to the engine (its own compile failures count)",
    )
    ap.add_argument(
        "--show-unfinished",
        action="store_true",
        help="print the end of every document that ran out of tokens",
    )
    args = ap.parse_args(argv)

    from radixlm.srt.models.default_model import resolve_model_path
    from radixlm.srt.models.model_config import ModelConfig
    from radixlm.srt.models.tokenizer import load_tokenizer

    subsets = args.subsets.split(",") if args.subsets else None
    cases = load_cases(args.data_dir, args.limit, subsets)
    if not cases:
        raise ValueError(f"no schemas for --subsets {args.subsets}")
    reports: dict[str, SubsetReport] = {}
    for case in cases:
        reports.setdefault(case.subset, SubsetReport()).cases.append(case)
    model_dir = resolve_model_path(None)
    tokenizer = load_tokenizer(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    eos = sorted(set(config.eos_token_ids) | {tokenizer.eos_token_id})
    if args.skip_coverage:
        for report in reports.values():
            report.compiles["auto"] = [CompileResult(True, 0.0)] * len(report.cases)
    else:
        print(f"{len(cases)} schemas from {args.data_dir}; compiling (budget {args.budget_s:g} s)")
        backends = make_backends(tokenizer, eos, config.vocab_size)
        run_coverage(cases, backends, args.budget_s, reports)
    if not args.skip_generation:
        from radixlm.srt import Engine

        print(f"generating (greedy, at most {args.max_new_tokens} tokens per document)")
        engine = Engine(log_level="warning", max_total_tokens=32768)
        try:
            run_generation(engine, reports, args.max_new_tokens, args.max_schema_chars)
        finally:
            engine.shutdown()
    if not args.skip_coverage:
        print_compile_table(with_overall(reports), args.budget_s)
    if not args.skip_generation:
        print_generation_table(with_overall(reports))
        print_failures(reports)
        if args.show_unfinished:
            print_unfinished(reports)


if __name__ == "__main__":
    main()
