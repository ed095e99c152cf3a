"""GPU benchmark on a randomly initialised Llama-3-8B-shaped model (no download), side by side.

    python -m radixlm.srt.bench.bench_gpu                     # everything, one run
    python -m radixlm.srt.bench.bench_gpu --sections calib,decode --backends triton

Sections: ``calib`` (copy bandwidth, bf16 matmul rate, the decode roofline = weight bytes /
bandwidth), ``decode`` (batch-1 inter-token latency and output throughput at batch 64 and 256,
1,024 in / 256 out, per attention backend, with and without CUDA graphs and overlap scheduling), ``prefill``
(prefill tokens/s), ``prefix`` (shared-prefix workload, radix cache on and off), ``hf``
(transformers' ``generate`` on the same shapes: eager, and its static-cache compiled path).
Prints one table; ``--json`` also writes the figures to a file.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import time
import traceback
from pathlib import Path

import torch

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
LLAMA3_70B = dict(
    LLAMA3_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)
SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}

# a tiny Llama for GPU tests of kernels and scheduling (random weights, every backend's head size)
TINY_LLAMA = dict(
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def make_model_folder(path: Path, shape: dict, config_class: str = "LlamaConfig") -> Path:
    """config.json (of transformers' ``config_class``, e.g. ``Qwen3MoeConfig``) plus a
    word-level tokenizer covering every id (outputs stay decodable)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    getattr(transformers, config_class)(
        **shape,
        architectures=[config_class.removesuffix("Config") + "ForCausalLM"],
        torch_dtype="bfloat16",
        bos_token_id=0,
        eos_token_id=1,
    ).save_pretrained(path)
    write_word_tokenizer(path, shape["vocab_size"])
    return path


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ids ``0 .. vocab_size - 1`` (``t<id>``; ``t0`` unknown and
    bos, ``t1`` eos) saved into ``path``: random-weight models need no downloaded tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t0"
    ).save_pretrained(path)


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def cuda_ms(fn, reps: int, warmup: int = 1) -> float:
    """Milliseconds per call of ``fn`` on the GPU's clock (CUDA events around ``reps`` calls,
    after ``warmup`` untimed ones)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def graphed(step):
    """``step`` captured in a CUDA graph: its replay (no launch gaps between kernels, no host
    time in the figure)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: Triton compiles, cuBLAS picks its kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def calibrate(weight_bytes: int) -> dict:
    n = 2 * 1024**3  # 4 GiB of bf16 read + 4 GiB written per copy
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    t = min(timed(lambda: b.copy_(a)) for _ in range(5))  # noqa: F821 - runs before the del
    bandwidth = 2 * a.numel() * 2 / t
    del a, b
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    m @ m
    t = min(timed(lambda: m @ m) for _ in range(5))
    flops = 2 * 8192**3 / t
    torch.cuda.empty_cache()
    return {
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "bf16_matmul_TFLOPs": flops / 1e12,
        "weight_GB": weight_bytes / 1e9,
        "roofline_ms_per_token": weight_bytes / bandwidth * 1e3,
    }


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def generate(engine, ids: list[list[int]], out_len: int) -> float:
    params = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    engine.flush_cache()
    return timed(lambda: engine.generate(input_ids=ids, sampling_params=params))


def bench_engine(
    folder: Path,
    backend: str,
    graphs: bool,
    args,
    vocab: int,
    overlap: bool = True,
    tp: int = 1,
    extra=None,
) -> dict:
    """Engine figures; ``extra(engine, figures so far)`` (a dict, merged in) runs last, before
    the engine is released."""
    from radixlm.srt import Engine

    engine = Engine(
        model_path=str(folder),
        tp_size=tp,
        load_format="dummy",
        attention_backend=backend,
        disable_cuda_graph=not graphs,
        disable_overlap_schedule=not overlap,
        max_running_requests=256,
        mem_fraction_static=0.85,
        log_level="warning",
        quantization=getattr(args, "quantization", "none"),  # fp8: at load, no check
        quantization_check="off",
    )
    try:
        runner = engine.scheduler.runner
        out: dict = {
            "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
            "cuda_graphs": runner.graph_runner is not None,  # decode captured (asked: graphs)
        }
        one = prompts(1, 128, vocab, seed=1)
        generate(engine, [one[0]], 8)  # warm-up
        t1 = generate(engine, [one[0]], 1)
        tn = generate(engine, [one[0]], 1 + args.itl_tokens)
        out["itl_ms_b1"] = (tn - t1) / args.itl_tokens * 1e3
        for bs in args.batch_sizes:
            ids = prompts(bs, args.input_len, vocab, seed=bs)
            generate(engine, ids[:2], 4)
            t_prefill = generate(engine, ids, 1)
            t = generate(engine, ids, args.output_len)
            out[f"tok_s_b{bs}"] = bs * args.output_len / t  # end to end, prefill included
            out[f"decode_tok_s_b{bs}"] = bs * (args.output_len - 1) / (t - t_prefill)
        if "hf" in args.sections and graphs and overlap:  # the workloads transformers runs too
            for n_in, n_out in args.vs_hf:
                ids = prompts(128, n_in, vocab, seed=5)
                generate(engine, ids[:2], 4)
                t = generate(engine, ids, n_out)
                out[f"tok_s_b128_{n_in}x{n_out}"] = 128 * n_out / t
        if "prefill" in args.sections:
            ids = prompts(32, args.input_len, vocab, seed=7)
            t = generate(engine, ids, 1)
            out["prefill_tok_s"] = 32 * args.input_len / t
        if extra is not None:
            out.update(extra(engine, dict(out)))
        return out
    finally:
        release(engine)


def bench_prefix(folder: Path, backend: str, args, vocab: int) -> dict:
    from radixlm.srt import Engine

    rng = random.Random(3)
    groups = [[rng.randrange(2, vocab) for _ in range(1000)] for _ in range(8)]
    reqs = [g + [rng.randrange(2, vocab) for _ in range(24)] for g in groups for _ in range(16)]
    best = sum(len(g) for g in groups) * 15 / sum(len(r) for r in reqs)
    out = {"best_hit_rate": best}
    for cache_on in (True, False):
        engine = Engine(
            model_path=str(folder),
            load_format="dummy",
            attention_backend=backend,
            disable_radix_cache=not cache_on,
            log_level="warning",
        )
        try:
            params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
            engine.generate(input_ids=reqs[:2], sampling_params=params)
            engine.flush_cache()
            res: list = []
            t = timed(lambda: res.extend(engine.generate(input_ids=reqs, sampling_params=params)))  # noqa: B023 - timed() calls it in this iteration
            hit = sum(r["meta_info"]["cached_tokens"] for r in res) / sum(
                r["meta_info"]["prompt_tokens"] for r in res
            )
            key = "on" if cache_on else "off"
            out[f"req_s_cache_{key}"] = len(reqs) / t
            out[f"hit_rate_cache_{key}"] = hit
        finally:
            release(engine)
    return out


def bench_hf(folder: Path, args, vocab: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    out = {}
    ids = torch.tensor(prompts(1, 128, vocab, seed=1), device="cuda")

    def gen(x, n, **kw):
        with torch.inference_mode():
            return model.generate(  # noqa: F821 - called before the del
                x,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=1,
                **kw,
            )

    gen(ids, 4)
    t1, tn = timed(lambda: gen(ids, 1)), timed(lambda: gen(ids, 65))
    out["hf_eager_itl_ms_b1"] = (tn - t1) / 64 * 1e3
    for n_in, n_out in args.vs_hf:  # batch 128, end to end (prefill included) and decode only
        big = torch.tensor(prompts(128, n_in, vocab, seed=5), device="cuda")
        gen(big[:2], 2)
        t_prefill = timed(lambda: gen(big, 1))  # noqa: B023, F821 - timed() calls it at once
        t = timed(lambda: gen(big, n_out))  # noqa: B023, F821 - timed() calls it at once
        out[f"hf_eager_tok_s_b128_{n_in}x{n_out}"] = 128 * n_out / t
        out[f"hf_eager_decode_tok_s_b128_{n_in}x{n_out}"] = 128 * (n_out - 1) / (t - t_prefill)
        del big
    if not args.skip_hf_static:
        try:
            kw = dict(cache_implementation="static")
            for _ in range(2):  # compile with the shapes it is measured on
                gen(ids, 65, **kw)
                gen(ids, 1, **kw)
            t1, tn = timed(lambda: gen(ids, 1, **kw)), timed(lambda: gen(ids, 65, **kw))
            out["hf_static_itl_ms_b1"] = (tn - t1) / 64 * 1e3
        except Exception as e:  # noqa: BLE001 - report and keep the other figures
            out["hf_static_error"] = repr(e)[:300]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def param_bytes(shape: dict) -> int:
    """bf16 bytes of a Llama of ``shape`` (untied embedding and LM head)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return 2 * (n * per_layer + 2 * shape["vocab_size"] * h + h)


def tp_calibration(calib: dict, shape: dict, tp: int) -> dict:
    """All-reduce timings over ``tp`` GPUs and the batch-1 TP roofline they imply."""
    from radixlm.srt.bench.collective_calib import measure, tp_roofline_ms

    rows = measure(tp, "cuda")
    message = 2 * shape["hidden_size"]  # one token's hidden state in bf16
    weights = int(calib.get("weight_GB", 0) * 1e9) or param_bytes(shape)
    copy_bps = calib["copy_bandwidth_TBps"] * 1e12
    return {
        "allreduce": rows,
        "tp_roofline_ms_per_token": tp_roofline_ms(
            weights, copy_bps, tp, shape["num_hidden_layers"], message, rows
        ),
    }


def release(engine) -> None:
    engine.shutdown()
    engine.scheduler = None
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sections", default="calib,decode,prefill,prefix,hf")
    ap.add_argument("--backends", default="flashinfer,triton")
    ap.add_argument("--graphs", default="on,off")
    ap.add_argument("--overlap", default="on,off", help="overlap scheduling on, off, or both")
    ap.add_argument(
        "--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256]
    )
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--itl-tokens", type=int, default=128)
    ap.add_argument(
        "--vs-hf",
        default="1024x128,128x512",
        type=lambda s: [tuple(int(v) for v in w.split("x")) for w in s.split(",")],
        help="batch-128 workloads (input x output tokens) run by transformers' eager "
        "generate and by our engine (graphs and overlap on), end to end",
    )
    ap.add_argument("--skip-hf-static", action="store_true")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="Llama-3 8B or 70B")
    ap.add_argument(
        "--tp-sizes",
        default="1",
        help="tensor-parallel sizes of the decode section, e.g. 1,2,4,8 (one GPU per rank); "
        "the calib section then also times all-reduces and gives each size's roofline",
    )
    ap.add_argument(
        "--quantization",
        default="none",
        choices=("none", "fp8"),
        help="fp8: the engine sections with FP8 weights quantised at load (per channel)",
    )
    ap.add_argument("--folder", default="/tmp/radixlm-llama3-8b-shape")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.sections = args.sections.split(",")
    shape = dict(SHAPES[args.shape])
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    if args.shape != "8b" and args.folder == "/tmp/radixlm-llama3-8b-shape":
        args.folder = f"/tmp/radixlm-llama3-{args.shape}-shape"
    folder = make_model_folder(Path(args.folder), shape)
    vocab = shape["vocab_size"]
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    weight_bytes = 0

    def section(name, fn):
        try:
            results[name] = fn()
            print(name, json.dumps(results[name]), flush=True)
        except Exception:  # noqa: BLE001 - one failing section must not hide the others
            results[name] = {"error": traceback.format_exc()[-800:]}
            print(name, "FAILED", results[name]["error"], flush=True)

    if "decode" in args.sections or "prefill" in args.sections:
        for backend, g, ov, tp in itertools.product(
            args.backends.split(","), args.graphs.split(","), args.overlap.split(","), tp_sizes
        ):
            name = f"{backend}/graphs-{g}" + ("" if ov == "on" else "/no-overlap")
            name += "" if tp == 1 else f"/tp{tp}"
            section(
                name,
                lambda b=backend, g=g, ov=ov, tp=tp: bench_engine(
                    folder, b, g == "on", args, vocab, overlap=ov == "on", tp=tp
                ),
            )
            if tp == 1:
                weight_bytes = weight_bytes or results[name].get("weight_bytes", 0)
    if "calib" in args.sections:
        section("calib", lambda: calibrate(weight_bytes or param_bytes(shape)))
        for tp in (t for t in tp_sizes if t > 1):
            section(f"calib/tp{tp}", lambda tp=tp: tp_calibration(results["calib"], shape, tp))
    if "prefix" in args.sections:
        section("prefix", lambda: bench_prefix(folder, args.backends.split(",")[0], args, vocab))
    if "hf" in args.sections:
        section("hf", lambda: bench_hf(folder, args, vocab))
    print(json.dumps(results, indent=1))
    hf = results.get("hf", {})
    for name, res in results.items():
        for n_in, n_out in args.vs_hf:
            key = f"tok_s_b128_{n_in}x{n_out}"
            if isinstance(res, dict) and key in res and f"hf_eager_{key}" in hf:
                print(
                    f"batch 128, {n_in} in / {n_out} out: {name} {res[key]:,.0f} tok/s vs "
                    f"transformers eager {hf[f'hf_eager_{key}']:,.0f} tok/s = "
                    f"{res[key] / hf[f'hf_eager_{key}']:.1f}x"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
