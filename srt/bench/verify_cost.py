"""What verifying a draft costs on a GPU: one step with k draft tokens per request against a plain
decode step (8B-shaped random model by default).

    python -m radixlm.srt.bench.verify_cost --batch-sizes 1,8,32 --draft-lens 0,1,2,4,6,8

Each batch holds requests with ``--context`` cached tokens; a step computes 1 + k new tokens per
request (the last token and a k-token draft; k = 0 is a plain decode step) with every row's
logits, through ``ModelRunner`` as the server runs it: verify batches replay the decode CUDA
graphs as one row per token (``ForwardBatch.as_decode_rows``), and the same step eagerly (the
extend kernels, no graphs) is timed beside it. Sampling and the acceptance rule are left out
(they are the same host work with or without graphs).

The cost ratio r(k) = step(k) / step(0) turns an acceptance into a speed-up: with acceptance
rate a per draft token (independent tokens), a verify yields (1 - a^(k+1)) / (1 - a) tokens for
r(k) decode steps' time; ``--accept-rates`` lists the rates to tabulate (e.g. the rates
``bench_speculative`` measured on the CPU with the default model). Also printed: the copy
bandwidth and the weights-only roofline of a decode step, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from radixlm.srt.bench.bench_gpu import (
    SHAPES,
    calibrate,
    cuda_ms,
    make_model_folder,
    param_bytes,
)


def expected_tokens(accept_rate: float, k: int) -> float:
    """Tokens one verify of a k-token draft yields (accepted drafts plus the target's own
    token), when each draft token is accepted with probability ``accept_rate`` given the
    previous ones were."""
    if accept_rate >= 1.0:
        return k + 1.0
    return (1.0 - accept_rate ** (k + 1)) / (1.0 - accept_rate)


def _step_batch(runner, reqs: list[tuple[int, torch.Tensor]], context: int, k: int):
    from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode

    n = 1 + k
    ids, pos, slots = [], [], []
    for _, kv in reqs:
        ids += [7] * n
        pos += list(range(context, context + n))
        slots.append(kv[context : context + n])
    return ForwardBatch.from_host(
        ForwardMode.DECODE if k == 0 else ForwardMode.EXTEND,
        ids,
        pos,
        torch.cat(slots),
        [slot for slot, _ in reqs],
        [context] * len(reqs),
        [n] * len(reqs),
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
    )


def _time_steps(runner, make_batch, iters: int) -> float:
    """Milliseconds per step, batches built inside the loop (host work included, as served)."""

    def step():
        fb = make_batch()
        runner._run(fb, list(range(fb.num_tokens)))

    with torch.inference_mode():
        return cuda_ms(step, iters, warmup=3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--draft-lens", default="0,1,2,3,4,6,8")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--accept-rates", default="0.5,0.7,0.9")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    from radixlm.srt.config import config_from_kwargs
    from radixlm.srt.executor.model_runner import ModelRunner

    batches = [int(x) for x in args.batch_sizes.split(",")]
    lens = sorted({0, *(int(x) for x in args.draft_lens.split(","))})
    rates = [float(x) for x in args.accept_rates.split(",")]
    shape = SHAPES[args.shape]
    calib = calibrate(param_bytes(shape))
    print(json.dumps({"calibration": calib}), flush=True)
    folder = make_model_folder(Path(tempfile.mkdtemp()) / args.shape, shape)
    max_k = max(lens)
    runner = ModelRunner(
        config_from_kwargs(
            model_path=str(folder),
            load_format="dummy",
            attention_backend=args.backend,
            kv_cache_dtype=args.kv_cache_dtype,
            max_running_requests=min(512, max(batches) * (1 + max_k)),
            speculative_algorithm="ngram",
            speculative_num_draft_tokens=max(1, max_k),
            mem_fraction_static=0.85,
            log_level="warning",
        )
    )
    results: dict = {"calibration": calib, "backend": args.backend, "context": args.context}
    rows = []
    for bs in batches:
        reqs = []
        for _ in range(bs):
            slot = runner.req_to_token_pool.alloc()
            kv = runner.allocator.alloc(args.context + max_k + 1)
            runner.req_to_token_pool.write(slot, 0, kv)
            reqs.append((slot, kv))
        base = None
        for k in lens:
            graph_ms = _time_steps(
                runner,
                lambda k=k, reqs=reqs: _step_batch(runner, reqs, args.context, k),
                args.iters,
            )
            saved, runner.max_verify_rows = runner.max_verify_rows, 1  # the extend path
            saved_graphs = runner.graph_runner
            if k == 0:
                runner.graph_runner = None
            try:
                eager_ms = _time_steps(
                    runner,
                    lambda k=k, reqs=reqs: _step_batch(runner, reqs, args.context, k),
                    args.iters,
                )
            finally:
                runner.max_verify_rows, runner.graph_runner = saved, saved_graphs
            base = graph_ms if k == 0 else base
            ratio = graph_ms / base
            row = {
                "batch": bs,
                "draft_len": k,
                "graph_ms": round(graph_ms, 3),
                "eager_ms": round(eager_ms, 3),
                "cost_ratio": round(ratio, 3),
                "speedup_at": {str(a): round(expected_tokens(a, k) / ratio, 3) for a in rates},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        for slot, kv in reqs:
            runner.req_to_token_pool.free(slot)
            runner.allocator.free(kv)
    results["rows"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
