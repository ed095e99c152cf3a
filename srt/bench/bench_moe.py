"""GPU benchmark of a Mixture-of-Experts model: random Qwen3-30B-A3B-shaped weights (no download).

    python -m radixlm.srt.bench.bench_moe                    # one GPU, every figure
    python -m radixlm.srt.bench.bench_moe --json moe.json

Shape: 48 layers, hidden 2048, 128 experts of width 768 with 8 active per token, 32 query and
4 KV heads of 128, vocabulary 151,936, bf16. Figures, measured in one run with their limits:

* ``calib``: copy bandwidth and bf16 matmul rate; the **active-weight roofline** (the bytes a
  batch-1 decode step must read: attention, router, the 8 chosen experts per layer and the LM
  head, over the copy bandwidth) and the **prefill FLOP limit** (2 FLOPs per active parameter
  per token over the matmul rate, attention's own FLOPs left out);
* ``engine``: batch-1 inter-token latency with decode in CUDA graphs (and its ratio to the
  roofline; the target is <= 1.3x), decode tokens/s at batch 64 and 256 (1,024 in / 256 out),
  prefill tokens/s;
* ``engine_no_graphs``: batch-1 inter-token latency again without CUDA graphs (the launch
  overhead the graphs remove);
* ``experts``: the fused MoE kernel alone on a decode step's routed rows (random routing) at
  each batch, times 48 layers, as a share of the measured decode step (batch 1 included: the
  small-batch kernels).
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch

from radixlm.srt.bench.bench_gpu import bench_engine, calibrate, cuda_ms, make_model_folder

QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,  # dense layers only (none here: every layer is sparse)
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def active_params(shape: dict) -> dict[str, int]:
    """Parameters one token reads per decode step (``decode``: LM head included, embedding
    lookup a row) and multiplies in a prefill (``flops``: 2 x these, LM head left out)."""
    h, hd = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    attention = h * (q + 2 * kv) + q * h + 2 * hd  # projections, q/k norms
    experts = shape["num_experts_per_tok"] * 3 * h * shape["moe_intermediate_size"]
    router = shape["num_experts"] * h
    per_layer = attention + experts + router + 2 * h
    layers = shape["num_hidden_layers"] * per_layer
    return {"decode": layers + shape["vocab_size"] * h + h, "prefill": layers}


def limits(shape: dict, calib: dict) -> dict:
    active = active_params(shape)
    bandwidth = calib["copy_bandwidth_TBps"] * 1e12
    flops = calib["bf16_matmul_TFLOPs"] * 1e12
    return {
        "active_decode_GB": 2 * active["decode"] / 1e9,
        "active_roofline_ms_per_token": 2 * active["decode"] / bandwidth * 1e3,
        "prefill_flop_limit_tok_s": flops / (2 * active["prefill"]),
    }


def expert_ms(shape: dict, batch: int, reps: int = 20) -> float:
    """Milliseconds of the fused MoE kernel (routing included) for ``batch`` decode rows, one
    layer, random routing."""
    from radixlm.kernels.fused_moe import fused_experts, route_topk

    h, inter, e = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_experts"]
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(batch, h, device=dev, dtype=bf16)
    router = torch.randn(e, h, device=dev, dtype=bf16) * 0.02
    gate_up = torch.randn(e, 2 * inter, h, device=dev, dtype=bf16) * 0.02
    down = torch.randn(e, h, inter, device=dev, dtype=bf16) * 0.02

    def step():
        weights, ids = route_topk(x @ router.T, shape["num_experts_per_tok"], "softmax", True)
        fused_experts(x, gate_up, down, ids, weights)

    return cuda_ms(step, reps, warmup=3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backend", default="triton")
    ap.add_argument(
        "--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256]
    )
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--itl-tokens", type=int, default=128)
    ap.add_argument("--folder", default="/tmp/radixlm-qwen3-30b-a3b-shape")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.sections = ["decode", "prefill"]
    shape = dict(QWEN3_30B_A3B)
    folder = make_model_folder(Path(args.folder), shape, config_class="Qwen3MoeConfig")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def section(name, fn):
        try:
            results[name] = fn()
            print(name, json.dumps(results[name]), flush=True)
        except Exception:  # noqa: BLE001 - one failing section must not hide the others
            results[name] = {"error": traceback.format_exc()[-800:]}
            print(name, "FAILED", results[name]["error"], flush=True)

    section("engine", lambda: bench_engine(folder, args.backend, True, args, shape["vocab_size"]))

    def calib_section() -> dict:
        calib = calibrate(2 * active_params(shape)["decode"])  # weight bytes: the active ones
        return {**calib, **limits(shape, calib)}

    section("calib", calib_section)
    itl_only = argparse.Namespace(**{**vars(args), "batch_sizes": [], "sections": []})
    section(
        "engine_no_graphs",
        lambda: bench_engine(folder, args.backend, False, itl_only, shape["vocab_size"]),
    )
    engine, calib = results.get("engine", {}), results.get("calib", {})
    roofline = calib.get("active_roofline_ms_per_token")
    for figures in (engine, results.get("engine_no_graphs", {})):
        if "itl_ms_b1" in figures and roofline:
            figures["itl_over_roofline"] = figures["itl_ms_b1"] / roofline
    if "itl_ms_b1" in engine:
        section(
            "experts_b1",
            lambda: {
                "expert_ms_per_step": (ms := shape["num_hidden_layers"] * expert_ms(shape, 1)),
                "step_ms": engine["itl_ms_b1"],
                "expert_share": ms / engine["itl_ms_b1"],
            },
        )
    for bs in args.batch_sizes:
        key = f"decode_tok_s_b{bs}"
        if key in engine:
            step_ms = bs / engine[key] * 1e3
            section(
                f"experts_b{bs}",
                lambda bs=bs, step_ms=step_ms: {
                    "expert_ms_per_step": (ms := shape["num_hidden_layers"] * expert_ms(shape, bs)),
                    "step_ms": step_ms,
                    "expert_share": ms / step_ms,
                },
            )
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
