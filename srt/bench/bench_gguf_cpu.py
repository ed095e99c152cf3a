"""The C++ GGUF GEMVs (``kernels/gguf_cpu.py``) alone, at a decode step's shapes.

    python -m radixlm.srt.bench.bench_gguf_cpu                       # 1, 4, 16 rows, 1 and 2 threads
    python -m radixlm.srt.bench.bench_gguf_cpu --against 20e9c05     # and the kernels of a commit

Times, per row count and thread count, what one decode step of the default model's shapes
(SmolLM2-135M: 30 layers of QKV, o, gate/up and down, hidden 576, intermediate 1536; random
weights) spends in its 120 Q4_1 GEMVs and in the Q8_0 LM head (int16 activations, vocabulary
49,152), best of ``--rounds``. ``--against REV`` builds the same kernels from
``kernels/gguf_cpu.py`` at a git revision and alternates the two in every round (the machine
may be shared), printing the ratio; a revision from before the float16 Q4_1 scales and mins
gets float32 copies of the same values. The step's weights fit in this machine's caches only in
part (about 80 MB with the head), as in a real step, though each round repeats them.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import time
from pathlib import Path

import torch

from radixlm.kernels import gguf_cpu
from radixlm.kernels.cpu_decode import compile_library
from radixlm.kernels.int4_cpu import quantize_int4
from radixlm.srt.bench.bench_cpu import cpu_model


def library_at(rev: str) -> ctypes.CDLL:
    """``kernels/gguf_cpu.py``'s kernels as they were at git revision ``rev`` (their C++ source
    in ``kernels/gguf_cpu_kernels.py``, or in ``gguf_cpu.py`` itself before the split)."""
    root = Path(__file__).resolve().parents[2]
    text = None
    for path in ("kernels/gguf_cpu_kernels.py", "kernels/gguf_cpu.py"):
        shown = subprocess.run(
            ["git", "-C", str(root), "show", f"{rev}:{path}"], capture_output=True, text=True
        )
        if shown.returncode == 0:
            text = shown.stdout
            break
    if text is None:
        raise RuntimeError(f"no gguf_cpu kernels at {rev}")
    namespace: dict = {}
    exec(compile(text, f"gguf_cpu@{rev}", "exec"), namespace)  # the module defines SOURCE
    lib = compile_library("radixlm_gguf", namespace["SOURCE"], gguf_cpu.FLAGS)
    if lib is None:
        raise RuntimeError(f"the kernels at {rev} did not build")
    return gguf_cpu.bind(lib)


class Step:
    """One decode step's GEMV shapes with random weights: ``layers`` x (qkv, o, gate_up, down)
    Q4_1 and a Q8_0 head."""

    def __init__(self, hidden: int, inter: int, qkv: int, layers: int, vocab: int):
        shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
        gen = torch.Generator().manual_seed(0)
        self.linears = [  # distinct weights per layer, as a real step reads
            (gguf_cpu.pack_q4_1(*quantize_int4(torch.randn(n, k, generator=gen) * 0.05)), n, k)
            for _ in range(layers)
            for n, k in shapes
        ]
        self.head = gguf_cpu.quantize_q8_0(torch.randn(vocab, hidden, generator=gen) * 0.05)
        self._f32: list[tuple[gguf_cpu.Q4_1, int, int]] = []

    def linears_for(self, lib: ctypes.CDLL) -> list[tuple[gguf_cpu.Q4_1, int, int]]:
        """The Q4_1 weights in the layout ``lib`` takes: float16 scales and mins, or float32
        ones for builds older than that layout (the same values)."""
        if getattr(lib, "q4_1_layout", 0) == gguf_cpu.Q4_1_LAYOUT:
            return self.linears
        if not self._f32:
            self._f32 = [
                (gguf_cpu.Q4_1(w.codes, w.d.float(), w.m.float()), n, k) for w, n, k in self.linears
            ]
        return self._f32

    def linears_s(self, lib: ctypes.CDLL, rows: int, threads: int) -> float:
        xs = {k: torch.randn(rows, k) for _, _, k in self.linears}
        out = torch.empty(rows, max(n for _, n, _ in self.linears))
        linears = self.linears_for(lib)
        start = time.perf_counter()
        for w, n, k in linears:
            ptrs = (w.codes.data_ptr(), w.d.data_ptr(), w.m.data_ptr())
            lib.q4_1_f32(xs[k].data_ptr(), rows, k, k, *ptrs, n, out.data_ptr(), threads)
        return time.perf_counter() - start

    def head_s(self, lib: ctypes.CDLL, rows: int, threads: int) -> float:
        vocab, k = self.head.codes.shape
        x, out = torch.randn(rows, k), torch.empty(rows, vocab)
        ptrs = (self.head.codes.data_ptr(), self.head.d.data_ptr())
        start = time.perf_counter()
        lib.q8_0_x16_f32(x.data_ptr(), rows, k, k, *ptrs, vocab, out.data_ptr(), threads)
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--against", default=None, help="a git revision's kernels beside these")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args(argv)
    libs = {"now": gguf_cpu.library()}
    if args.against:
        libs = {args.against: library_at(args.against), **libs}
    print(f"CPU: {cpu_model()}")
    step = Step(hidden=576, inter=1536, qkv=960, layers=args.layers, vocab=49152)
    names = list(libs)
    print(f"{'rows':>4} {'thr':>3}  {'part':<8}" + "".join(f"{n:>14}" for n in names) + "  ratio")
    for threads in (int(t) for t in args.threads.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            best = {(n, part): float("inf") for n in names for part in ("linears", "head")}
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    lib = libs[name]
                    lin = step.linears_s(lib, rows, threads)
                    best[name, "linears"] = min(best[name, "linears"], lin)
                    best[name, "head"] = min(best[name, "head"], step.head_s(lib, rows, threads))
            for part in ("linears", "head"):
                ms = [best[n, part] * 1e3 for n in names]
                ratio = f"  {ms[0] / ms[-1]:.2f}x" if len(ms) > 1 else ""
                cells = "".join(f"{v:>11.2f} ms" for v in ms)
                print(f"{rows:>4} {threads:>3}  {part:<8}{cells}{ratio}")
    print("(best of the rounds; ratio: the first column's time over the last's)")


if __name__ == "__main__":
    main()
