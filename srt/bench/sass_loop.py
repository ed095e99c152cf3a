"""Static instruction profile of the int4 kernels' K loops, compiled for Hopper (sm_90) on any
machine: no GPU needed, only Triton's bundled ``ptxas`` and ``cuobjdump``.

    python -m radixlm.srt.bench.sass_loop
    python -m radixlm.srt.bench.sass_loop --json sass_loop.json

For each kernel and launch configuration it compiles the kernel (bf16 activations, group 128
unless named),
finds the K loop in the SASS (the longest backward branch), and prints the loop's instructions
per weight: ``loop instructions x threads / weights an iteration``, the lane-instructions a
weight costs in steady state, with the most frequent opcodes. A memory-bound kernel has a
budget: an H100 SXM issues 132 SMs x 4 warp-instructions x 32 lanes a cycle (about 30e12
lane-instructions/s at 1.75 GHz) while int4 weights arrive at 6e12/s (3 TB/s): about five
a weight at full issue, fewer in practice. Launch and tail costs are not in these figures (the
GPU timings of ``tune_quant`` are).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from radixlm.kernels import int4_mm as im
from radixlm.kernels import quant_gemm as qg
from radixlm.kernels import quant_gemv as qv

GROUP = 128
ALIGNED = ("ptr", "K", "stride")  # arguments Triton sees as multiples of 16 at 8B shapes


def _signature(fn, pointers: dict, constexprs: dict) -> tuple[dict, dict]:
    """Triton signature and divisibility attributes for ``fn``: pointer types from
    ``pointers``, constexprs from ``constexprs``, every other argument i32."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = pointers.get(name, "i32")
        if any(tag in name for tag in ALIGNED):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _sass(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


def loop_opcodes(sass: str) -> Counter:
    """Opcodes of the longest loop (backward branch) of a kernel's SASS."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]+);", sass)]
    loop = (0, -1)
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > loop[1] - loop[0]:
            loop = (int(m.group(1), 16), addr)
    ops = Counter()
    for addr, text in ins:
        if loop[0] <= addr <= loop[1]:
            words = text.split()
            ops[(words[1] if words[0].startswith("@") else words[0]).split(".")[0]] += 1
    return ops


def profile(fn, pointers, constexprs, warps, stages, weights_per_iter) -> dict:
    """Compile the Python kernel function ``fn`` for sm_90 (a JIT function of its own, also
    where ``TRITON_INTERPRET`` is set) and profile its K loop."""
    fn = JITFunction(fn)
    sig, attrs = _signature(fn, pointers, constexprs)
    kernel = triton.compile(
        ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    ops = loop_opcodes(_sass(kernel))
    per_weight = sum(ops.values()) * 32 * warps / weights_per_iter
    mma = sum(n for op, n in ops.items() if op in ("HGMMA", "HMMA"))  # tensor cores
    return {
        "per_weight": per_weight,
        "loop": sum(ops.values()),
        "mma": mma,
        "top": ops.most_common(8),
    }


def cases() -> list[tuple[str, object, dict, dict, int, int, int]]:
    """(label, kernel, pointer types, constexprs, warps, stages, weights an iteration)."""
    bf16 = {"x_ptr": "*bf16", "s_ptr": "*bf16", "z_ptr": "*bf16", "y_ptr": "*bf16"}
    out = []
    for rows, group in ((1, GROUP), (16, GROUP), (64, GROUP), (128, GROUP), (1, 64), (1, 32)):
        c = im.int4_mm_config(rows, 4096, 4096, group)
        const = {k: c[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        const.update(GROUP=group, ASM=True, IS_BF16=True)
        ptrs = {**bf16, "h_ptr": "*i16", "ws_ptr": "*fp32", "count_ptr": "*i32"}
        label = f"int4_mm rows {rows} ({const['BLOCK_M']}x{const['BLOCK_N']}x{const['BLOCK_K']})"
        label += f", group {group}" if group != GROUP else ""
        weights = c["BLOCK_N"] * c["BLOCK_K"]
        out.append(
            (label, im._int4_mm_kernel, ptrs, const, c["num_warps"], c["num_stages"], weights),
        )
    for rows in (1, 4):
        c = qv.int4_gemv_config(rows, 4096, 4096, GROUP)
        const = {k: c[k] for k in ("BLOCK_M", "BLOCK_N", "SUB", "NC")}
        const["NUM_STAGES"] = c["num_stages"]
        weights = c["BLOCK_N"] * c["SUB"] * c["NC"]
        ptrs = {**bf16, "q_ptr": "*i32"}
        label = f"int4 GEMV rows {rows} (fp32 path)"
        out.append((label, qv._int4_gemv_kernel, ptrs, const, c["num_warps"], 1, weights))
    for rows in (16, 64):
        c = qg.int4_config(rows, 4096, 4096, GROUP)
        const = {k: c[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}
        ptrs = {**bf16, "q_ptr": "*i32", "y_ptr": "*fp32"}
        weights = c["BLOCK_N"] * c["BLOCK_K"]
        label = f"int4 tiled rows {rows} (fp32 path)"
        out.append((label, qg._int4_kernel, ptrs, const, c["num_warps"], c["num_stages"], weights))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    print("kernel | loop instructions (a warp) | lane-instructions / weight | top opcodes")
    for label, fn, ptrs, const, warps, stages, weights in cases():
        r = profile(fn, ptrs, const, warps, stages, weights)
        top = " ".join(f"{op} {n}" for op, n in r["top"])
        print(f"{label} | {r['loop']} | {r['per_weight']:.2f} | {top}", flush=True)
        rows.append({"kernel": label, **r})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": "sm_90", "triton": triton.__version__, "rows": rows}, f)


if __name__ == "__main__":
    main()
