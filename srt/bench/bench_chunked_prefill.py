"""Decode stalls behind one long prompt, per chunked-prefill size (the scheduler, no HTTP).

    python -m radixlm.srt.bench.bench_chunked_prefill --prompt-len 8000 \\
        --chunk-sizes=-1,256,512,1024,2048,2048u           # CPU, the default model
    python -m radixlm.srt.bench.bench_chunked_prefill --dummy-8b --prompt-len 8000 \\
        --num-decodes 32 --chunk-sizes=-1,1024,2048,4096,8192   # GPU, Llama-3-8B shapes
    python -m radixlm.srt.bench.bench_chunked_prefill --dummy-8b --prompt-len 8000 \\
        --num-decodes 32 --decode-prompt-len 2048 --chunk-sizes=8192,8192u --profile
        # GPU: where a mixed step's time goes against a prefill-only one

``--num-decodes`` requests decode (short prompts, endless greedy outputs); then a
``--prompt-len``-token prompt arrives. Per chunk size (``-1``: off; a ``u`` suffix: chunks run
alone, ``--disable-mixed-chunk``) the table gives the time until that prompt's first token, its
prefill rate, the longest gap between two tokens of a running request meanwhile, and how many
tokens each running request got meanwhile. The same scheduler serves every size in turn, the
prefix cache emptied in between. ``--decode-prompt-len`` sets the running requests' prompts (their
context, which their decode rows attend to). ``--profile`` (CUDA) also records the device time of
the long prompt's steps by kernel category (``decode_profile.CATEGORIES``), the top kernels, and
the device's busy share of the wall time: a mixed step against a prefill-only one, kernel by
kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def measure(
    s: Scheduler,
    prompt_len: int,
    num_decodes: int,
    seed: int,
    decode_prompt_len: int = 16,
    profile: bool = False,
) -> dict:
    """One long prompt behind ``num_decodes`` running requests (prompts of
    ``decode_prompt_len`` tokens): its TTFT and the decode gaps; ``profile`` (CUDA): the device
    time of the long prompt's steps too (:func:`device_profile`)."""
    rng = random.Random(seed)
    vocab = s.runner.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(n)]

    for i in range(num_decodes):
        prompt = ids(decode_prompt_len)
        s.handle(TokenizedGenerateReq(f"d{i}", prompt, {**GREEDY, "max_new_tokens": 1 << 20}))
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
    prof = _profiler(s) if profile else contextlib.nullcontext()
    with prof:
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
    out = {
        "ttft_s": ttft,
        "prefill_tok_s": prompt_len / ttft,
        "steps": steps,
        "max_gap_s": max(gaps) if gaps else ttft,
        "tokens_meanwhile": len(gaps),
        "decode_step_s": decode_step_s,
    }
    if profile:
        out["profile"] = device_profile(prof, ttft, steps)
    return out


def _profiler(s: Scheduler):
    """A CUDA profiler around the long prompt's steps (the model on a CUDA device only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if s.runner.device.type != "cuda":
        raise ValueError("--profile needs the model on a CUDA device (kernel times)")
    torch.cuda.synchronize()
    return profile(activities=[ProfilerActivity.CUDA])


def device_profile(prof, wall_s: float, steps: int, top: int = 12) -> dict:
    """Device milliseconds a step by kernel category, the ``top`` kernels (ms a step, launches
    a step), and the device's busy share of the wall time."""
    from radixlm.srt.bench.decode_profile import kernel_times

    per_cat, per_kernel, calls = kernel_times(prof)
    busy = sum(per_cat.values())
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "busy_share": busy / wall_s if wall_s else 0.0,
        "category_ms_per_step": {c: round(v * 1e3 / steps, 3) for c, v in sorted(per_cat.items())},
        "top_kernels": [(k[:80], round(v * 1e3 / steps, 3), calls[k] / steps) for k, v in ranked],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--dummy-8b", action="store_true", help="random Llama-3-8B-shaped weights")
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--num-decodes", type=int, default=4)
    ap.add_argument(
        "--decode-prompt-len", type=int, default=16, help="the running requests' prompts"
    )
    ap.add_argument("--profile", action="store_true", help="device time by kernel (CUDA)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--chunk-sizes", default="-1,256,512,1024,2048")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="default: prompt + 4096")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default=None, help="default: the server's default")
    args = ap.parse_args(argv)
    chunks = [parse_chunk(c) for c in args.chunk_sizes.split(",")]
    options = {}
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if args.dummy_8b:
        from radixlm.srt.bench.bench_gpu import LLAMA3_8B, make_model_folder

        folder = make_model_folder(Path("/tmp/radixlm-llama3-8b-shape"), dict(LLAMA3_8B))
        options.update(model_path=str(folder), load_format="dummy")
    elif args.model_path:
        options["model_path"] = args.model_path
    s = Scheduler(
        config_from_kwargs(
            log_level="warning",
            max_total_tokens=args.max_total_tokens
            or args.prompt_len + args.num_decodes * args.decode_prompt_len + 4096,
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
        row.update(
            measure(
                s,
                args.prompt_len,
                args.num_decodes,
                args.seed,
                args.decode_prompt_len,
                args.profile,
            )
        )
        rows.append(row)
        label = "off" if size < 0 else f"{size}{'' if mixed else 'u'}"
        print(
            f"{label:>8}{row['ttft_s']:>10.2f}{row['prefill_tok_s']:>10.0f}{row['steps']:>7}"
            f"{row['max_gap_s']:>11.3f}{row['tokens_meanwhile']:>8}",
            flush=True,
        )
        if "profile" in row:
            pr = row["profile"]
            cats = ", ".join(f"{c} {v:.2f}" for c, v in pr["category_ms_per_step"].items())
            print(f"{'':>8}device busy {pr['busy_share']:.0%} of the wall time; ms a step: {cats}")
            for name, ms, n in pr["top_kernels"][:6]:
                print(f"{'':>10}{ms:8.3f} ms {n:6.1f}x  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(
        f"(a decode step of {args.num_decodes} requests alone: {rows[-1]['decode_step_s']:.3f} s)"
    )
    s.close()
    return rows


if __name__ == "__main__":
    main()
