"""JSON-schema coverage of the ``auto`` grammar backend: which schemas compile, which are
refused and why, how long compiling takes, and whether the documents the grammar admits
validate.

    python -m radixlm.srt.bench.schema_coverage ../shared/data/jsonschemabench
    python -m radixlm.srt.bench.schema_coverage tests/grammar/data/schema_constructs.jsonl
    python -m radixlm.srt.bench.schema_coverage DIR --tokenizer default --walks 0

Inputs: folders of ``*.json`` files (a jsonschemabench file's ``schema`` key, else the file
itself is the schema) and ``*.jsonl`` files (one ``{"id": ..., "schema": ...}`` per line).

Each schema is compiled the way the server does (``GrammarConfig()``: outlines-core within its
budget, llguidance, lenient llguidance) in a forked child that is killed after ``--limit-s``,
so one slow schema cannot slow the next. The child then drives ``--walks`` random walks over
the grammar (``grammar.testing.closing_walk``: random allowed tokens, ending strings more and
more often) and validates every document a walk finishes with ``jsonschema`` (the validator of
the schema's ``$schema`` draft, formats checked), against the whole schema and against the
schema without the keywords the grammar reported as unenforced (``CompiledGrammar.unenforced``).

``--tokenizer tiny`` (default) is the 500-token byte-level BPE of the grammar tests (trained
offline, fast walks); ``default`` is the default model's tokenizer (compile times as a server
sees them; walks are slower there).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Case:
    name: str
    schema: Any


@dataclass
class Outcome:
    name: str
    ok: bool
    seconds: float
    reason: str = ""  # why it was refused
    backend: str = ""  # which engine compiled it
    unenforced: list[str] = field(default_factory=list)
    finished: int = 0  # walks that ended
    valid: int = 0  # finished documents valid against the whole schema
    valid_enforced: int = 0  # ... against the schema without the unenforced keywords
    invalid_example: str = ""


def load_cases(paths: list[Path]) -> list[Case]:
    cases: list[Case] = []
    for path in paths:
        if path.is_dir():
            for file in sorted(path.glob("*.json")):
                data = json.loads(file.read_text())
                is_bench = isinstance(data, dict) and "schema" in data and "tests" in data
                cases.append(Case(file.stem, data["schema"] if is_bench else data))
            for file in sorted(path.glob("*.jsonl")):
                cases += load_cases([file])
        elif path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    cases.append(Case(str(entry["id"]), entry["schema"]))
        else:
            data = json.loads(path.read_text())
            cases.append(Case(path.stem, data.get("schema", data) if "tests" in data else data))
    return cases


def make_vocab(tokenizer: str):
    from radixlm.grammar import build_vocab

    if tokenizer == "tiny":
        from radixlm.grammar.testing import train_byte_level_tokenizer

        return build_vocab(train_byte_level_tokenizer())
    from radixlm.srt.models.default_model import resolve_model_path
    from radixlm.srt.models.model_config import ModelConfig
    from radixlm.srt.models.tokenizer import load_tokenizer

    model_dir = resolve_model_path(None)
    hf_tokenizer = load_tokenizer(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    eos = sorted(set(config.eos_token_ids) | {hf_tokenizer.eos_token_id})
    return build_vocab(hf_tokenizer, eos, config.vocab_size)


# ---------------------------------------------------------------------- validation
def without_keywords(schema: Any, keywords: list[str]) -> Any:
    """``schema`` without ``keywords`` (``format:<name>`` drops that format, ``oneOf`` turns
    into ``anyOf``: both engines compile it so) in every schema object."""
    from radixlm.grammar.schema_checks import schema_nodes

    plain = {k for k in keywords if not k.startswith("format:")}
    formats = {k.split(":", 1)[1] for k in keywords if k.startswith("format:")}
    enforced = copy.deepcopy(schema)
    for node in list(schema_nodes(enforced)):
        for key in plain:
            node.pop(key, None)
        if node.get("format") in formats:
            del node["format"]
        if "oneOf" in node and "oneOf" in plain:
            node["anyOf"] = node.pop("oneOf")
    return enforced


def validator_for(schema: Any):
    """A ``jsonschema`` validator (formats checked), or None when it cannot judge."""
    import jsonschema
    from jsonschema.validators import validator_for as pick

    try:
        cls = pick(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        return cls(schema, format_checker=cls.FORMAT_CHECKER)
    except Exception:  # an invalid schema by jsonschema's own meta-schema
        return None


def is_valid(validator, document: Any) -> bool:
    try:
        return validator.is_valid(document)
    except Exception:  # unresolvable $ref, a pattern Python's re cannot read
        return False


# ---------------------------------------------------------------------- one schema
def _run_case(backend, vocab, closers, case: Case, walks: int, conn) -> None:
    from radixlm.grammar import GrammarSpec
    from radixlm.grammar.testing import closing_walk

    start = time.perf_counter()
    try:
        grammar = backend.compile(GrammarSpec.json_schema(json.dumps(case.schema)))
    except Exception as e:
        conn.send(Outcome(case.name, False, time.perf_counter() - start, _first_line(e)))
        return
    outcome = Outcome(case.name, True, time.perf_counter() - start)
    outcome.backend = getattr(grammar, "compiled_by", grammar.backend_name)
    outcome.unenforced = list(getattr(grammar, "unenforced", ()))
    full = validator_for(case.schema)
    enforced = validator_for(without_keywords(case.schema, outcome.unenforced))
    rng = random.Random(case.name)
    for _ in range(walks):
        ids, ended = closing_walk(grammar.new_matcher(), vocab, rng, closers)
        if not ended:
            continue
        outcome.finished += 1
        text = vocab.decode_bytes(ids).decode("utf-8", "replace")
        try:
            document = json.loads(text)
        except ValueError:
            outcome.invalid_example = outcome.invalid_example or f"not JSON: {text[:120]!r}"
            continue
        ok_full = full is not None and is_valid(full, document)
        outcome.valid += ok_full
        outcome.valid_enforced += enforced is not None and is_valid(enforced, document)
        if not ok_full and not outcome.invalid_example:
            outcome.invalid_example = text[:160]
    conn.send(outcome)


def run_case(backend, vocab, closers, case: Case, walks: int, limit_s: float) -> Outcome:
    """``case`` compiled (and walked) in a forked child, killed after ``limit_s``."""
    ctx = mp.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    args = (backend, vocab, closers, case, walks, sender)
    child = ctx.Process(target=_run_case, args=args, daemon=True)
    start = time.perf_counter()
    child.start()
    try:
        if receiver.poll(limit_s):
            return receiver.recv()
        return Outcome(case.name, False, time.perf_counter() - start, f"over {limit_s:g} s")
    finally:
        child.kill()
        child.join()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# ---------------------------------------------------------------------- report
def summarize(outcomes: list[Outcome]) -> list[str]:
    compiled = [o for o in outcomes if o.ok]
    lines = [
        f"compiled {len(compiled)}/{len(outcomes)} "
        f"({100 * len(compiled) / max(1, len(outcomes)):.1f}%), "
        f"refused {len(outcomes) - len(compiled)}"
    ]
    reasons = Counter(o.reason[:110] for o in outcomes if not o.ok)
    for reason, count in reasons.most_common():
        names = [o.name for o in outcomes if not o.ok and o.reason[:110] == reason]
        lines.append(f"  {count} x {reason}  [{', '.join(names[:4])}]")
    seconds = [o.seconds for o in compiled]
    if seconds:
        q = np.percentile(seconds, [50, 90, 99])
        lines.append(
            f"compile time of compiled schemas (s): p50 {q[0]:.3f}, p90 {q[1]:.3f}, "
            f"p99 {q[2]:.3f}, max {max(seconds):.3f}"
        )
    every = [o.seconds for o in outcomes]
    edges = (0.1, 0.5, 1.0, 3.0, 5.0, 10.0)
    buckets = [sum(s <= e for s in every) for e in edges]
    lines.append(
        "all schemas within: "
        + ", ".join(f"{e:g} s {b}" for e, b in zip(edges, buckets, strict=True))
        + f", longest {max(every, default=0):.2f} s"
    )
    by_backend = Counter(o.backend for o in compiled)
    lines.append("compiled by: " + ", ".join(f"{k} {v}" for k, v in by_backend.most_common()))
    keywords = Counter(k for o in compiled for k in o.unenforced)
    if keywords:
        lines.append(
            f"schemas with unenforced keywords: {sum(bool(o.unenforced) for o in compiled)} ("
            + ", ".join(f"{k} {v}" for k, v in keywords.most_common())
            + ")"
        )
    finished = sum(o.finished for o in compiled)
    if finished:
        valid = sum(o.valid for o in compiled)
        valid_enforced = sum(o.valid_enforced for o in compiled)
        lines.append(
            f"walk documents: {finished} finished; valid against the schema {valid}/{finished} "
            f"({100 * valid / finished:.1f}%); against its enforced keywords "
            f"{valid_enforced}/{finished} ({100 * valid_enforced / finished:.1f}%)"
        )
        for o in compiled:
            if o.valid < o.finished:
                lines.append(f"  invalid {o.name} ({o.finished - o.valid}): {o.invalid_example}")
    return lines


def main(argv: list[str] | None = None) -> list[Outcome]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("paths", type=Path, nargs="+", help="folders of .json / .jsonl files")
    ap.add_argument("--tokenizer", choices=("tiny", "default"), default="tiny")
    ap.add_argument("--walks", type=int, default=4, help="random walks per compiled schema")
    ap.add_argument("--limit-s", type=float, default=30.0, help="kill a schema's child after")
    ap.add_argument("--quiet", action="store_true", help="summary only")
    args = ap.parse_args(argv)

    from radixlm.grammar import GrammarConfig, create_grammar_backend
    from radixlm.grammar.testing import closing_tokens

    cases = load_cases(args.paths)
    vocab = make_vocab(args.tokenizer)
    backend = create_grammar_backend(GrammarConfig(), vocab)
    # tokenizer tables are built once here, not in every child (a server builds them at start)
    backend.llguidance.lltokenizer()
    backend.outlines.outlines_vocabulary()
    closers = closing_tokens(vocab) if args.walks else frozenset()
    outcomes = []
    for case in cases:
        outcome = run_case(backend, vocab, closers, case, args.walks, args.limit_s)
        outcomes.append(outcome)
        if not args.quiet:
            extra = f" unenforced: {', '.join(outcome.unenforced)}" if outcome.unenforced else ""
            walked = f" walks {outcome.valid}/{outcome.finished} valid" if outcome.finished else ""
            state = f"ok {outcome.backend}" if outcome.ok else f"REFUSED: {outcome.reason[:140]}"
            print(f"{outcome.seconds:7.3f}s {case.name}: {state}{walked}{extra}", flush=True)
    backend.shutdown()
    print("\n".join(summarize(outcomes)))
    return outcomes


if __name__ == "__main__":
    main()
