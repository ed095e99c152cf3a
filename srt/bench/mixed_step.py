"""Attention of one mixed chunked-prefill step, one layer (GPU, triton): a prefill chunk of
``--chunk`` tokens on top of ``--chunk-prefix`` cached ones, plus ``--decode-rows`` running
requests of ``--decode-len`` cached tokens computing one token each.

    python -m radixlm.srt.bench.mixed_step --decode-rows 256 --decode-len 1100 --chunk 8192

Compares the extend kernel over every row (how mixed steps ran before) with the split the
triton backend now makes (extend kernel for the chunk, decode kernel for the decode rows), on
the same pool, and checks that both give the same output. Llama-3-8B heads (32 query, 8 KV, 128).
"""

from __future__ import annotations

import argparse
import json

import torch

from radixlm.kernels.attention.triton_decode import decode_attention
from radixlm.kernels.attention.triton_extend import extend_attention
from radixlm.srt.bench.bench_gpu import cuda_ms


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--decode-rows", type=int, default=256)
    ap.add_argument("--decode-len", type=int, default=1100)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--chunk-prefix", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    heads, kv_heads, dim = 32, 8, 128
    b, n = args.decode_rows, args.decode_len
    ctx = max(n, args.chunk_prefix + args.chunk)
    total = b * n + args.chunk_prefix + args.chunk
    k_buf = torch.randn(total + 1, kv_heads, dim, dtype=dtype, device=dev)
    v_buf = torch.randn_like(k_buf)
    table = torch.zeros(b + 2, ctx, dtype=torch.int64, device=dev)
    perm = torch.randperm(total, device=dev) + 1  # scattered slots, as in a used pool
    table[1, : args.chunk_prefix + args.chunk] = perm[: args.chunk_prefix + args.chunk]
    rest = perm[args.chunk_prefix + args.chunk :].view(b, n)
    table[2:, :n] = rest
    req_slots = torch.arange(1, b + 2, device=dev)
    prefix = [args.chunk_prefix] + [n - 1] * b
    ext = [args.chunk] + [1] * b
    q = torch.randn(args.chunk + b, heads * dim, dtype=dtype, device=dev)
    dims = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, scaling=dim**-0.5)

    def meta(p, e):
        starts = [sum(e[:i]) for i in range(len(e))]
        m = torch.tensor([p, e, starts], dtype=torch.int32, device=dev)
        return m[0], m[1], m[2]

    all_meta = meta(prefix, ext)
    chunk_meta = meta(prefix[:1], ext[:1])
    seq_lens = torch.tensor([n] * b, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    splits = max(1, min(16, -(-2 * sms // (b * kv_heads))))

    def old():
        return extend_attention(q, k_buf, v_buf, table, req_slots, *all_meta, max(ext), **dims)

    def new():
        out = torch.empty_like(q)
        c = args.chunk
        extend_attention(
            q[:c], k_buf, v_buf, table, req_slots[:1], *chunk_meta, c, out=out[:c], **dims
        )
        decode_attention(
            q[c:],
            k_buf,
            v_buf,
            table,
            req_slots[1:],
            seq_lens,
            num_splits=splits,
            out=out[c:],
            **dims,
        )
        return out

    err = (old().float() - new().float()).abs().max().item()
    only_chunk = cuda_ms(
        lambda: extend_attention(
            q[: args.chunk], k_buf, v_buf, table, req_slots[:1], *chunk_meta, args.chunk, **dims
        ),
        20,
    )
    res = {
        "device": torch.cuda.get_device_name(),
        "args": vars(args),
        "extend_kernel_all_rows_ms": cuda_ms(old, 20),
        "split_ms": cuda_ms(new, 20),
        "chunk_alone_ms": only_chunk,
        "max_abs_diff": err,
    }
    res["speedup"] = res["extend_kernel_all_rows_ms"] / res["split_ms"]
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
