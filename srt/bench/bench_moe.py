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
  small-batch kernels);
* ``profile_b1`` (in ``engine`` and ``engine_no_graphs``): where a batch-1 decode step's time
  goes, from ``torch.profiler`` (``decode_profile.profile_case``): device time per kernel
  category (MoE experts, MoE routing, attention, GEMMs, norms/rope, ...), the top 15 kernels by
  time with their launches per step, kernels per step, GPU busy time against the step.

Each phase runs in its own process (``--phase``), so that one phase's engine, weights, KV pool
and graphs are gone before the next starts, and a phase that fails leaves the others' figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from radixlm.srt.bench.bench_gpu import (
    bench_engine,
    calibrate,
    cuda_ms,
    graphed,
    make_model_folder,
)

PHASES = ("calib", "engine", "engine_no_graphs", "experts")  # calib first: the profile uses it
PROFILE_STEPS = 32  # decode steps of the profiled run (a run of 9 steps is subtracted)
PROFILE_INPUT_LEN = 128  # the batch-1 ITL's prompt length

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
    layer, random routing, replayed from a CUDA graph as in the engine (timed eagerly, the
    host's launches of the small kernels were the figure: 0.15 ms a layer at batch 1 against
    0.03 in the engine's profile)."""
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

    return cuda_ms(graphed(step), reps, warmup=3)


def profile_b1(engine, shape: dict, bandwidth_TBps: float | None) -> dict:
    """``decode_profile.profile_case`` at batch 1, against the active-weight bytes."""
    from radixlm.srt.bench.decode_profile import model_bytes, profile_case

    _, kv_per_token = model_bytes(engine.scheduler.runner)
    args = argparse.Namespace(
        input_len=PROFILE_INPUT_LEN,
        steps=PROFILE_STEPS,
        trace_dir=None,
        weight_bytes=2 * active_params(shape)["decode"],
    )
    bandwidth = (bandwidth_TBps or NOMINAL_TBPS) * 1e12
    try:
        out = profile_case(engine, 1, args, shape["vocab_size"], kv_per_token, bandwidth)
    except Exception:  # noqa: BLE001 - the engine's own figures stand without the profile
        return {"profile_b1": {"error": traceback.format_exc()[-1500:]}}
    out["bandwidth_TBps"] = bandwidth / 1e12
    out["bandwidth_measured"] = bandwidth_TBps is not None
    return {"profile_b1": out}


def _profile_after(engine, figures: dict, shape: dict, args) -> dict:
    """The engine's figures written first (a crash in the profiler keeps them), then the
    profile."""
    Path(args.phase_json).write_text(json.dumps(figures))
    return profile_b1(engine, shape, args.bandwidth)


NOMINAL_TBPS = 3.35  # H100 SXM's data-sheet bandwidth, when the calib phase left no figure


def run_phase(name: str, args, shape: dict, folder: Path) -> dict:
    """One phase in this process (the ``--phase`` child; it writes ``--phase-json``)."""
    vocab = shape["vocab_size"]
    if name == "calib":
        calib = calibrate(2 * active_params(shape)["decode"])  # weight bytes: the active ones
        return {"device": torch.cuda.get_device_name(), **calib, **limits(shape, calib)}
    if name in ("engine", "engine_no_graphs"):
        graphs = name == "engine"
        run_args = (
            args
            if graphs
            else argparse.Namespace(**{**vars(args), "batch_sizes": [], "sections": []})
        )
        out = bench_engine(
            folder,
            args.backend,
            graphs,
            run_args,
            vocab,
            extra=lambda engine, figures: _profile_after(engine, figures, shape, args),
        )
        # the engine is released: what it left allocated on the device (near zero expected)
        out["gpu_GiB_after_release"] = torch.cuda.memory_allocated() / 2**30
        return out
    if name == "experts":
        return {f"expert_ms_b{bs}": expert_ms(shape, bs) for bs in [1, *args.batch_sizes]}
    raise ValueError(f"unknown phase {name!r}; the phases are {', '.join(PHASES)}")


def combine(results: dict, shape: dict, batch_sizes: list[int]) -> dict:
    """The phases' figures set against each other: ITL over the roofline, the expert kernels'
    share of each measured step (48 layers of ``expert_ms``)."""
    engine, calib = results.get("engine", {}), results.get("calib", {})
    roofline = calib.get("active_roofline_ms_per_token")
    for figures in (engine, results.get("engine_no_graphs", {})):
        if "itl_ms_b1" in figures and roofline:
            figures["itl_over_roofline"] = figures["itl_ms_b1"] / roofline
    experts = results.get("experts", {})
    steps = {1: engine.get("itl_ms_b1")}
    for bs in batch_sizes:
        tok_s = engine.get(f"decode_tok_s_b{bs}")
        steps[bs] = bs / tok_s * 1e3 if tok_s else None
    for bs, step_ms in steps.items():
        one_layer = experts.get(f"expert_ms_b{bs}")
        if one_layer is not None and step_ms:
            ms = shape["num_hidden_layers"] * one_layer
            results[f"experts_b{bs}"] = {
                "expert_ms_per_step": ms,
                "step_ms": step_ms,
                "expert_share": ms / step_ms,
            }
    return results


def _child(name: str, argv: list[str], bandwidth: float | None) -> dict:
    """Runs phase ``name`` in a fresh interpreter; its figures, or why there are none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{name}.json"
        cmd = [sys.executable, "-m", __spec__.name if __spec__ else "radixlm.srt.bench.bench_moe"]
        cmd += [*argv, "--phase", name, "--phase-json", str(out)]
        if bandwidth is not None:
            cmd += ["--bandwidth", str(bandwidth)]
        code = subprocess.run(cmd, check=False).returncode
        if out.is_file():
            return json.loads(out.read_text())
        return {"error": f"the {name} phase exited with code {code} and left no figures"}


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
    ap.add_argument("--phases", default=",".join(PHASES), help="which phases, in this order")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # a child: one phase
    ap.add_argument("--phase-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bandwidth", type=float, default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    args.sections = ["decode", "prefill"]
    shape = dict(QWEN3_30B_A3B)
    if args.phase is not None:
        folder = make_model_folder(Path(args.folder), shape, config_class="Qwen3MoeConfig")
        try:
            figures = run_phase(args.phase, args, shape, folder)
        except Exception:  # noqa: BLE001 - one failing phase must not hide the others
            figures = {"error": traceback.format_exc()[-1500:]}
        Path(args.phase_json).write_text(json.dumps(figures))
        return
    phases = args.phases.split(",")
    if unknown := [p for p in phases if p not in PHASES]:
        ap.error(f"unknown phase(s) {', '.join(unknown)}; the phases are {', '.join(PHASES)}")
    results: dict = {"torch": torch.__version__}
    for name in phases:
        bandwidth = results.get("calib", {}).get("copy_bandwidth_TBps")
        results[name] = _child(name, argv, bandwidth)
        print(name, json.dumps(results[name]), flush=True)
        if args.json:  # after every phase: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))
    results["device"] = results.get("calib", {}).get("device")
    combine(results, shape, args.batch_sizes)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
