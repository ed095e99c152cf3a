"""Offline throughput: this engine and transformers' ``generate`` side by side, same model and prompts.

    python -m radixlm.srt.bench.bench_offline                 # the default model, CPU
    python -m radixlm.srt.bench.bench_offline --output-len 128 --batch-size 16
    python -m radixlm.srt.bench.bench_offline --quantization none,int4   # our int4 mode too

Two workloads: one request (batch 1), and ``--batch-size`` requests of mixed prompt lengths
(transformers gets them as one left-padded batch, as its users would send them). Every request
decodes exactly ``--output-len`` tokens greedily (EOS ignored), so both sides do the same work.
Prints output tokens/s (prefill included), decode ms per step, and the ratio to transformers;
with ``--quantization none,int4`` our engine runs once per mode, each against the same
transformers timing (transformers always runs unquantized, in ``--dtype``).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

WORDS = (
    "the model reads a long document about rivers mountains cities and history then it "
    "answers questions with care while the scheduler batches many requests"
).split()


def make_prompts(tokenizer, n: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        target = min_len if n == 1 else min_len + (max_len - min_len) * i // max(n - 1, 1)
        words = [rng.choice(WORDS) for _ in range(target)]
        prompts.append(tokenizer.encode(" ".join(words))[:target])
    rng.shuffle(prompts)
    return prompts


def run_ours(engine, prompts: list[list[int]], output_len: int) -> float:
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    engine.flush_cache()  # no prefix reuse between runs: both sides prefill every prompt
    start = time.perf_counter()
    outs = engine.generate(
        input_ids=prompts if len(prompts) > 1 else prompts[0], sampling_params=params
    )
    elapsed = time.perf_counter() - start
    outs = outs if isinstance(outs, list) else [outs]
    assert all(o["meta_info"]["completion_tokens"] == output_len for o in outs)
    return elapsed


def run_transformers(model, tokenizer, prompts: list[list[int]], output_len: int) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + output_len
    return elapsed


PRECISIONS = {
    "none": "{dtype}",
    "int4": "int4 w, bf16 act",
}
INT4_NOTE = (
    "int4: linear weights 4-bit Q4_1 (for a Q4_1 GGUF, its own codes) and the LM head Q8_0, "
    "activations int8 (int16 for the head) per block of 32 in those matmuls, for forwards of "
    "at most {rows} token rows; more rows use the dense {dtype} weights"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct"
    )
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-prompt-len", type=int, default=32)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per cell (best is reported)")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and activations, the same on both sides",
    )
    ap.add_argument(
        "--quantization",
        default="none",
        help="comma list of our engine's --quantization modes to run side by side "
        "(none, int4); transformers always runs unquantized",
    )
    ap.add_argument(
        "--workloads", default="1,batch", help="which to run: 1 (batch 1), batch, or both"
    )
    args = ap.parse_args(argv)
    args.quantization = args.quantization.split(",")
    unknown = set(args.quantization) - set(PRECISIONS)
    if unknown:
        ap.error(f"unknown --quantization {sorted(unknown)}; choose from {sorted(PRECISIONS)}")
    return args


def make_workloads(tok, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    chosen = args.workloads.split(",")
    workloads = {}
    if "1" in chosen:
        workloads["batch 1"] = make_prompts(
            tok, 1, args.min_prompt_len * 4, args.min_prompt_len * 4
        )
    if "batch" in chosen:
        workloads[f"batch {args.batch_size}, mixed"] = make_prompts(
            tok, args.batch_size, args.min_prompt_len, args.max_prompt_len
        )
    return workloads


def timed(run, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, float]:
    """(seconds for ``--output-len`` tokens, decode ms per step): a step is the difference
    between the full run and a one-token run (prefill + first token), per later token."""
    run(prompts, 4)  # warm-up
    full = min(run(prompts, args.output_len) for _ in range(args.repeats))
    first = min(run(prompts, 1) for _ in range(args.repeats))
    return full, (full - first) / max(args.output_len - 1, 1) * 1e3


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    from radixlm.kernels import gguf_cpu
    from radixlm.srt import Engine

    engines = {
        q: Engine(
            model_path=args.model_path,
            log_level="warning",
            max_total_tokens=32768,
            dtype=args.dtype,
            quantization=q,
        )
        for q in args.quantization
    }
    first = next(iter(engines.values()))
    model_dir, tok = first.scheduler.runner.model_dir, first.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    print(
        f"model {model_dir}, {torch.get_num_threads()} threads, "
        f"output {args.output_len} tokens/request"
    )
    print(
        f"{'workload':<18}{'engine':<14}{'precision':<18}{'tok/s':>8}{'ms/step':>9}"
        f"{'vs transformers':>17}"
    )
    for name, prompts in make_workloads(tok, args).items():
        n = len(prompts) * args.output_len
        theirs, theirs_step = timed(lambda p, k: run_transformers(hf, tok, p, k), prompts, args)
        for q, engine in engines.items():
            ours, ours_step = timed(lambda p, k, e=engine: run_ours(e, p, k), prompts, args)
            precision = PRECISIONS[q].format(dtype=args.dtype)
            print(
                f"{name:<18}{'radixlm':<14}{precision:<18}{n / ours:>8.1f}{ours_step:>9.1f}"
                f"{theirs / ours:>16.2f}x"
            )
        print(
            f"{name:<18}{'transformers':<14}{args.dtype:<18}{n / theirs:>8.1f}"
            f"{theirs_step:>9.1f}{1:>16.2f}x"
        )
    if "int4" in engines:
        print(INT4_NOTE.format(rows=gguf_cpu.matmul_rows(), dtype=args.dtype))
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
