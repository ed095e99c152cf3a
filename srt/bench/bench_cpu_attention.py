"""The CPU decode attention kernel (``kernels/cpu_decode.decode_attention``) alone, per layer.

    python -m radixlm.srt.bench.bench_cpu_attention                     # SmolLM2's heads
    python -m radixlm.srt.bench.bench_cpu_attention --lens 160,1000 --heads 32 --kv-heads 8

Times one layer's call (the new K/V written, every (request, KV head) item) for a batch of
``--batch`` requests of each cached length in ``--lens``, float32 pool, over ``--layers``
distinct pool buffers in turn (as a step walks its layers: the cached K/V comes from the caches
as it would), best of ``--rounds``, beside torch's scaled_dot_product_attention on the same
rows gathered into contiguous tensors (the gather not timed): microseconds per layer.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from radixlm.kernels import cpu_decode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lens", default="16,160,1000", help="cached tokens a request, comma list")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="passes over the layers a round")
    return ap.parse_args(argv)


def bench(args: argparse.Namespace, length: int) -> tuple[float, float]:
    """(kernel, torch) microseconds per layer."""
    b, h, kvh, d = args.batch, args.heads, args.kv_heads, args.head_dim
    slots = b * (length + 1) + 16
    k_bufs = [torch.randn(slots, kvh, d) for _ in range(args.layers)]
    v_bufs = [torch.randn(slots, kvh, d) for _ in range(args.layers)]
    table = torch.arange(b * (length + 1), dtype=torch.int64).view(b, length + 1)
    batch = cpu_decode.DecodeBatch(
        table,
        torch.arange(b, dtype=torch.int64),
        torch.full((b,), length + 1, dtype=torch.int64),
        table[:, -1].contiguous(),
    )
    q = torch.randn(b, h * d)
    k_new, v_new = torch.randn(b, kvh * d), torch.randn(b, kvh * d)
    scale = d**-0.5
    keys = [k[table].transpose(1, 2) for k in k_bufs]  # [b, kvh, len + 1, d]
    values = [v[table].transpose(1, 2) for v in v_bufs]
    qs = q.view(b, h, 1, d)

    def kernel() -> None:
        for layer in range(args.layers):
            cpu_decode.decode_attention(
                batch, q, k_new, v_new, k_bufs[layer], v_bufs[layer], h, scale
            )

    def reference() -> None:
        for layer in range(args.layers):
            F.scaled_dot_product_attention(
                qs, keys[layer], values[layer], scale=scale, enable_gqa=True
            )

    best = {}
    for name, fn in (("kernel", kernel), ("torch", reference)):
        fn()
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.iters):
                fn()
            times.append((time.perf_counter() - start) / (args.iters * args.layers))
        best[name] = min(times) * 1e6
    return best["kernel"], best["torch"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_decode.available():
        raise SystemExit("the CPU kernels could not be built (no C++ compiler)")
    print(
        f"batch {args.batch}, {args.heads} query / {args.kv_heads} KV heads of "
        f"{args.head_dim}, {args.layers} layers, {args.threads} thread(s); us per layer"
    )
    print(f"{'cached':>8}{'kernel':>10}{'torch sdpa':>12}")
    for length in (int(x) for x in args.lens.split(",")):
        kernel, ref = bench(args, length)
        print(f"{length:>8}{kernel:>10.1f}{ref:>12.1f}")


if __name__ == "__main__":
    main()
