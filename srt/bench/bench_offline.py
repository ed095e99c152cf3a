"""Offline throughput: this engine and transformers' ``generate`` side by side, same model and prompts.

    python -m radixlm.srt.bench.bench_offline                 # the default model, CPU
    python -m radixlm.srt.bench.bench_offline --output-len 128 --batch-size 16

Two workloads: one request (batch 1), and ``--batch-size`` requests of mixed prompt lengths
(transformers gets them as one left-padded batch, as its users would send them). Every request
decodes exactly ``--output-len`` tokens greedily (EOS ignored), so both sides do the same work.
Prints output tokens/s for each and the ratio.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

WORDS = ("the model reads a long document about rivers mountains cities and history then it "
         "answers questions with care while the scheduler batches many requests").split()


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
    outs = engine.generate(input_ids=prompts if len(prompts) > 1 else prompts[0], sampling_params=params)
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
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + output_len
    return elapsed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-prompt-len", type=int, default=32)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per cell (best is reported)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and activations, the same on both sides")
    ap.add_argument("--workloads", default="1,batch", help="which to run: 1 (batch 1), batch, or both")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from radixlm.srt import Engine

    engine = Engine(model_path=args.model_path, log_level="warning", max_total_tokens=32768,
                    dtype=args.dtype)
    model_dir = engine.scheduler.runner.model_dir
    tok = engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    chosen = args.workloads.split(",")
    workloads = {}
    if "1" in chosen:
        workloads["batch 1"] = make_prompts(tok, 1, args.min_prompt_len * 4, args.min_prompt_len * 4)
    if "batch" in chosen:
        workloads[f"batch {args.batch_size}, mixed lengths"] = make_prompts(
            tok, args.batch_size, args.min_prompt_len, args.max_prompt_len)
    print(f"model {model_dir}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"output {args.output_len} tokens/request")
    print(f"{'workload':<28}{'radixlm tok/s':>15}{'transformers tok/s':>20}{'ratio':>8}")
    for name, prompts in workloads.items():
        run_ours(engine, prompts, 4)  # warm-up
        run_transformers(hf, tok, prompts, 4)
        ours = min(run_ours(engine, prompts, args.output_len) for _ in range(args.repeats))
        theirs = min(run_transformers(hf, tok, prompts, args.output_len) for _ in range(args.repeats))
        n = len(prompts) * args.output_len
        print(f"{name:<28}{n / ours:>15.1f}{n / theirs:>20.1f}{theirs / ours:>7.2f}x")
    engine.shutdown()


if __name__ == "__main__":
    main()
