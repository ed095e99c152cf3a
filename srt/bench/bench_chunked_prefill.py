"""Decode stalls behind one long prompt, per chunked-prefill size (the scheduler, no HTTP).

    python -m radixlm.srt.bench.bench_chunked_prefill --prompt-len 8000 \\
        --chunk-sizes=-1,256,512,1024,2048,2048u           # CPU, the default model
    python -m radixlm.srt.bench.bench_chunked_prefill --dummy-8b --prompt-len 8000 \\
        --num-decodes 32 --chunk-sizes=-1,1024,2048,4096,8192   # GPU, Llama-3-8B shapes

``--num-decodes`` requests decode (short prompts, endless greedy outputs); then a
``--prompt-len``-token prompt arrives. Per chunk size (``-1``: off; a ``u`` suffix: chunks run
alone, ``--disable-mixed-chunk``) the table gives the time until that prompt's first token, its
prefill rate, the longest gap between two tokens of a running request meanwhile, and how many
tokens each running request got meanwhile. The same scheduler serves every size in turn, the
prefix cache emptied in between.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import AbortReq, TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.prefill import PrefillAdmission

GREEDY = {"temperature": 0, "ignore_eos": True}


def parse_chunk(text: str) -> tuple[int, bool]:
    """``"512"`` -> (512, mixed); ``"512u"`` -> (512, unmixed); ``"-1"``: chunking off."""
    size = int(text.rstrip("u"))
    if size == 0 or size < -1:
        raise ValueError(f"chunk sizes are -1 (off) or > 0, got {text!r}")
    return size, not text.endswith("u")


def measure(s: Scheduler, prompt_len: int, num_decodes: int, seed: int) -> dict:
    """One long prompt behind ``num_decodes`` running requests: its TTFT and the decode gaps."""
    rng = random.Random(seed)
    vocab = s.runner.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(n)]

    for i in range(num_decodes):
        s.handle(TokenizedGenerateReq(f"d{i}", ids(16), {**GREEDY, "max_new_tokens": 1 << 20}))
    while len(s.running) < num_decodes or s.waiting or s.chunked is not None:
        s.step()
    for _ in range(3):  # settle into decode steps
        s.step()
    watched = s.running[0]
    start = time.perf_counter()
    for _ in range(5):
        s.step()
    decode_step_s = (time.perf_counter() - start) / 5
    s.handle(TokenizedGenerateReq("long", ids(prompt_len), {**GREEDY, "max_new_tokens": 2}))
    (long,) = [r for r in s.waiting if r.rid == "long"]
    start = last = time.perf_counter()
    gaps: list[float] = []
    steps = 0
    while not long.output_ids and not long.is_finished:
        before = len(watched.output_ids)
        s.step()
        steps += 1
        if len(watched.output_ids) > before:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    ttft = time.perf_counter() - start
    if long.is_finished and not long.output_ids:
        raise RuntimeError(f"the long prompt failed: {long.finish_reason}")
    s.handle(AbortReq(abort_all=True))
    while s.has_work():
        s.step()
    assert s.check_idle()
    return {
        "ttft_s": ttft,
        "prefill_tok_s": prompt_len / ttft,
        "steps": steps,
        "max_gap_s": max(gaps) if gaps else ttft,
        "tokens_meanwhile": len(gaps),
        "decode_step_s": decode_step_s,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--dummy-8b", action="store_true", help="random Llama-3-8B-shaped weights")
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--num-decodes", type=int, default=4)
    ap.add_argument("--chunk-sizes", default="-1,256,512,1024,2048")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="default: prompt + 4096")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    chunks = [parse_chunk(c) for c in args.chunk_sizes.split(",")]
    options = {}
    if args.dummy_8b:
        from radixlm.srt.bench.bench_gpu import LLAMA3_8B, make_model_folder

        folder = make_model_folder(Path("/tmp/radixlm-llama3-8b-shape"), dict(LLAMA3_8B))
        options = {"model_path": str(folder), "load_format": "dummy"}
    elif args.model_path:
        options = {"model_path": args.model_path}
    s = Scheduler(
        config_from_kwargs(
            log_level="warning",
            max_total_tokens=args.max_total_tokens or args.prompt_len + 4096,
            # the running requests never end: a reserve for their output would keep the long
            # prompt waiting forever; this measures the stall, not admission
            schedule_conservativeness=0,
            **options,
        )
    )
    rows = []
    print(f"{'chunk':>8}{'TTFT s':>10}{'tok/s':>10}{'steps':>7}{'max gap s':>11}{'tokens':>8}")
    for size, mixed in chunks:
        cfg = s.runner.cfg.replace(chunked_prefill_size=size, disable_mixed_chunk=not mixed)
        s.admission = PrefillAdmission(cfg, s.kv, s.stats)
        s.cache.reset()
        row = {"chunk": size, "mixed": mixed and size > 0}
        row.update(measure(s, args.prompt_len, args.num_decodes, args.seed))
        rows.append(row)
        label = "off" if size < 0 else f"{size}{'' if mixed else 'u'}"
        print(
            f"{label:>8}{row['ttft_s']:>10.2f}{row['prefill_tok_s']:>10.0f}{row['steps']:>7}"
            f"{row['max_gap_s']:>11.3f}{row['tokens_meanwhile']:>8}",
            flush=True,
        )
    print(
        f"(a decode step of {args.num_decodes} requests alone: {rows[-1]['decode_step_s']:.3f} s)"
    )
    s.close()
    return rows


if __name__ == "__main__":
    main()
