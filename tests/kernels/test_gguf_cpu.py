"""The C++ Q4_1 / Q8_0 GEMVs (``kernels/gguf_cpu.py``) on every path this machine can run (its
native build: AVX-512 VNNI, AVX-VNNI or AVX2; the AVX2 build; the scalar build) against the
dequantised torch reference: first the kernel's own arithmetic (int8 activations), then float
activations within a bound derived from the int8 rounding. The VNNI paths are compiled here
even where the CPU cannot run them."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from radixlm.kernels import gguf_cpu
from radixlm.kernels.int4_cpu import dequantize_int4, quantize_int4

pytestmark = pytest.mark.skipif(
    not gguf_cpu.available(), reason="the CPU kernels could not be built (no C++ compiler)"
)
VARIANTS = ("native", "avx2", "scalar")
SHAPES = [(1, 1, 32), (2, 7, 96), (3, 17, 64), (5, 100, 576), (16, 33, 160), (11, 64, 1536)]
# the Q4_1 tiles' edges: 8-row groups and their remainders, weight rows not a multiple of the
# tiles' 2 or 4, odd block counts (7, 9) and a block count past a multiple of 8 (the min terms)
SHAPES += [(8, 9, 224), (9, 6, 288), (4, 7, 32), (13, 45, 1056), (16, 31, 576)]
# the row counts int4 models send past the one-call step (up to gguf_cpu.MATMUL_ROWS)
SHAPES += [(37, 19, 160), (128, 33, 96)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 codes ``[M, K/32, 32]``, float16-rounded scales and scaled sums ``[M, K/32]``
    (what the kernels make of each activation block)."""
    m, k = x.shape
    blocks = x.double().reshape(m, k // 32, 32)
    d = (blocks.abs().amax(-1).float() / 127).double()
    inv = torch.where(d > 0, 1.0 / d.float().double(), torch.zeros_like(d))
    q = torch.round((blocks.float() * inv.float()[..., None]).double())
    sums = (d * q.sum(-1)).float()
    return q, d.half().double(), sums.half().double()


def slack(terms: torch.Tensor) -> torch.Tensor:
    """float32 summation error allowance over a sum of ``terms`` ``[M, N, blocks]``."""
    return 1e-5 * terms.abs().sum(-1) + 1e-6


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=gen(seed)) * 0.05 + 0.01


def activations(m: int, k: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen(seed)) * scale
    x[:, :32] *= 40  # blocks of very different ranges
    return x


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_q4_1_matches_the_dequantised_reference(variant, m, n, k):
    w, x = weights(n, k, n + k), activations(m, k, m)
    codes = quantize_int4(w)
    out = gguf_cpu.q4_1_matmul(x, gguf_cpu.pack_q4_1(*codes), variant)
    assert out.shape == (m, n) and out.dtype == torch.float32
    q, d, s = q8_1(x)
    wc = codes.codes.double().reshape(n, k // 32, 32)
    wd, wm = codes.scales.double(), codes.mins.double()
    # the kernel's arithmetic: integer block dots, scaled per block, plus min * block sum
    terms = torch.einsum("rbi,nbi->rnb", q, wc) * wd[None] * d[:, None] + wm[None] * s[:, None]
    exact = terms.sum(-1)
    assert ((out.double() - exact).abs() <= slack(terms)).all()
    # against float activations: each element is off by at most half an int8 step of its
    # block's scale plus the scale's float16 rounding (127 codes x 2**-11 relative), and each
    # min term by its sum's float16 rounding
    dense = dequantize_int4(codes).double()
    ref = x.double() @ dense.t()
    step = x.double().abs().reshape(m, k // 32, 32).amax(-1) / 127 * (0.5 + 127 * 2**-11)
    abs_w = dense.abs().reshape(n, k // 32, 32).sum(-1)
    bound = (step[:, None] * abs_w[None] + wm.abs()[None] * s.abs()[:, None] * 2**-10).sum(-1)
    assert ((out.double() - ref).abs() <= bound + slack(terms)).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_q4_1_float16_scales_and_mins(variant):
    """The packed weight keeps ``d`` and ``m`` as float16 and the kernels read every float16
    value as it is: subnormal, zero (of either sign), large; 9 blocks (a partial min step)."""
    n, k = 13, 288
    nb = k // 32
    g = gen(11)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    special = torch.tensor([6e-8, 3e-6, 6.1e-5, 0.0, -0.0, 1e-3, 0.5, 60.0, -2e-7])
    d = (torch.rand(n, nb, generator=g) * 0.02).half()
    m = (torch.randn(n, nb, generator=g) * 0.1).half()
    d[:, : len(special)] = special.abs().half()
    m[:, : len(special)] = special.flip(0).half()
    w = gguf_cpu.pack_q4_1(codes, d, m)
    assert w.d.dtype == w.m.dtype == torch.float16
    assert torch.equal(w.d.view(torch.int16), d.view(torch.int16))  # bit for bit, -0 included
    assert torch.equal(w.m.view(torch.int16), m.view(torch.int16))
    x = activations(3, k, 12)
    out = gguf_cpu.q4_1_matmul(x, w, variant)
    q, da, sa = q8_1(x)
    wc = codes.double().reshape(n, nb, 32)
    terms = torch.einsum("rbi,nbi->rnb", q, wc) * d.double()[None] * da[:, None]
    terms = terms + m.double()[None] * sa[:, None]
    assert ((out.double() - terms.sum(-1)).abs() <= slack(terms)).all()


def q16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 codes ``[M, K/32, 32]`` and scales ``[M, K/32]`` (the LM head's activations)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1) / 32767
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(blocks * inv[..., None]).double(), d.double()


@pytest.mark.parametrize("int16", [False, True], ids=["int8", "int16"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_q8_0_matches_the_dequantised_reference(variant, m, n, k, int16):
    w, x = weights(n, k, 2 * n + k), activations(m, k, m + 1)
    weight = gguf_cpu.quantize_q8_0(w)
    out = gguf_cpu.q8_0_matmul(x, weight, variant, int16=int16)
    q, d = q16(x) if int16 else q8_1(x)[:2]
    wc = weight.codes.double().reshape(n, k // 32, 32)
    terms = torch.einsum("rbi,nbi->rnb", q, wc) * weight.d.double()[None] * d[:, None]
    assert ((out.double() - terms.sum(-1)).abs() <= slack(terms)).all()
    dense = gguf_cpu.dequantize_q8_0(weight).double()
    amax = x.double().abs().reshape(m, k // 32, 32).amax(-1)
    # half a step of the block's scale (int8's scale also rounded to float16)
    step = amax / 32767 * 0.5001 if int16 else amax / 127 * (0.5 + 127 * 2**-11)
    bound = (step[:, None] * dense.abs().reshape(n, k // 32, 32).sum(-1)[None]).sum(-1)
    assert ((out.double() - x.double() @ dense.t()).abs() <= bound + slack(terms)).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_1_to_16_bf16_strided_and_zero_blocks(variant):
    n, k = 40, 128
    codes = quantize_int4(weights(n, k, 1))
    q4 = gguf_cpu.pack_q4_1(*codes)
    q8 = gguf_cpu.quantize_q8_0(weights(n, k, 2))
    for m in range(1, 17):
        x = torch.randn(m, k + 8, generator=gen(m))[:, 8:]  # strided rows, contiguous last dim
        x[:, 32:64] = 0  # an all-zero block: scale 0, codes 0
        expect = gguf_cpu.q4_1_matmul(x.contiguous(), q4, variant)
        assert torch.equal(gguf_cpu.q4_1_matmul(x, q4, variant), expect)
        # one row alone gives the same result as within the batch (rows are independent)
        assert torch.equal(gguf_cpu.q4_1_matmul(x[-1:], q4, variant), expect[-1:])
        xb = x.to(torch.bfloat16)
        for int16 in (False, True):
            bf16 = gguf_cpu.q8_0_matmul(xb, q8, variant, int16)
            assert torch.equal(bf16, gguf_cpu.q8_0_matmul(xb.float(), q8, variant, int16))


SPANS = [(0, 1), (1, 6), (6, 7), (7, 30), (30, 43)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0 int16"])
def test_rows_do_not_depend_on_batch_or_span(variant, fmt):
    """A row's result is the same alone, in any batch of 1-128 rows and in any span of output
    rows (the one-call step's chunks), bit for bit: the step equals the layer path."""
    n, k = 43, 160  # 5 blocks: one pair-less last block; 43 rows: tiles' tails
    lib = gguf_cpu.library(variant)
    if fmt == "q4_1":
        w = gguf_cpu.pack_q4_1(*quantize_int4(weights(n, k, 7)))
        matmul, span = (lambda x: gguf_cpu.q4_1_matmul(x, w, variant)), lib.q4_1_span_f32
    else:
        w = gguf_cpu.quantize_q8_0(weights(n, k, 7))
        matmul = lambda x: gguf_cpu.q8_0_matmul(x, w, variant, int16=True)  # noqa: E731
        span = lib.q8_0_x16_span_f32
    ptrs = [t.data_ptr() for t in w]
    x = activations(gguf_cpu.MATMUL_ROWS, k, 8)
    for m in (1, 2, 3, 4, 5, 8, 9, 12, 16, 37, gguf_cpu.MATMUL_ROWS):
        full = matmul(x[:m])
        for r in range(m):
            assert torch.equal(matmul(x[r : r + 1])[0], full[r])
        spans = torch.full((m, n), float("nan"))
        for i, (j0, j1) in enumerate(SPANS):
            span(x.data_ptr(), m, k, k, *ptrs, n, j0, j1, spans.data_ptr(), i == 0)
        assert torch.equal(spans, full)


def test_paths_agree_and_native_names_its_isa():
    assert gguf_cpu.isa("scalar") == "scalar"
    assert gguf_cpu.isa("avx2") in ("AVX2", "scalar")  # scalar on a CPU without AVX2
    assert gguf_cpu.isa("native") in gguf_cpu.ISA_NAMES
    codes = quantize_int4(weights(64, 576, 3))
    x = activations(4, 576, 4)
    outs = [gguf_cpu.q4_1_matmul(x, gguf_cpu.pack_q4_1(*codes), v) for v in VARIANTS]
    for out in outs[1:]:  # the same integer dots; only the float summation order differs
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "flags",
    [
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
        ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
    ],
    ids=["avx512-vnni", "avx-vnni"],
)
def test_vnni_paths_compile(flags, tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "gguf.cpp"
    # and the VNNI dot products are the ones compiled (not the scalar fallback)
    check = "\n#if !defined(RADIXLM_VNNI) && !defined(RADIXLM_AVXVNNI)\n#error no VNNI\n#endif\n"
    src.write_text(gguf_cpu.SOURCE + check)
    cmd = [compiler, "-O1", "-fopenmp", "-std=c++17", "-fPIC", *flags, "-c", str(src), "-o"]
    proc = subprocess.run([*cmd, str(tmp_path / "gguf.o")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_shapes_and_dtypes_are_checked():
    q8 = gguf_cpu.quantize_q8_0(weights(16, 64, 5))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        gguf_cpu.q8_0_matmul(torch.randn(2, 32), q8)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        gguf_cpu.q8_0_matmul(torch.randn(2, 64).half(), q8)
    with pytest.raises(ValueError, match="divisible by 32"):
        gguf_cpu.quantize_q8_0(torch.randn(4, 48))


def test_switches_turn_the_kernels_off(monkeypatch):
    x = torch.randn(1, 64)
    assert gguf_cpu.serves(x, 1) and not gguf_cpu.serves(x, gguf_cpu.MATMUL_ROWS + 1)
    with gguf_cpu.rows_limit(4):  # what benchmarks compare in one engine
        assert gguf_cpu.serves(x, 4) and not gguf_cpu.serves(x, 5)
    assert gguf_cpu.matmul_rows() == gguf_cpu.MATMUL_ROWS
    with pytest.raises(ValueError, match="at least 1"), gguf_cpu.rows_limit(0):
        pass
    with gguf_cpu.disabled():
        assert not gguf_cpu.available() and not gguf_cpu.serves(x, 1)
    assert gguf_cpu.available()
    monkeypatch.setenv("RADIXLM_CPU_GEMV", "0")
    monkeypatch.setattr(gguf_cpu, "_libs", {})
    assert gguf_cpu.library() is None and not gguf_cpu.available()


def test_library_override_swaps_the_kernels_for_a_block():
    """Benchmarks run another build of the kernels in place of the native one, the one-call
    step included (it keeps a kernel table per GEMV build)."""
    from radixlm.kernels import cpu_step

    native, scalar = gguf_cpu.library(), gguf_cpu.library("scalar")
    q4 = gguf_cpu.pack_q4_1(*quantize_int4(weights(8, 64, 9)))
    x = activations(3, 64, 10)
    step_native = cpu_step._library()
    with gguf_cpu.library_override(scalar):
        assert gguf_cpu.library() is scalar
        assert torch.equal(gguf_cpu.q4_1_matmul(x, q4), gguf_cpu.q4_1_matmul(x, q4, "scalar"))
        if step_native is not None:
            assert cpu_step._library()[1].tolist() != step_native[1].tolist()
    assert gguf_cpu.library() is native and cpu_step._library() is step_native


def test_library_override_refuses_another_q4_1_layout():
    """A build from before the float16 scales and mins would misread the packed weights."""

    class Older:
        q4_1_layout = 0

    native = gguf_cpu.library()
    assert native.q4_1_layout == gguf_cpu.Q4_1_LAYOUT
    with pytest.raises(ValueError, match="layout"), gguf_cpu.library_override(Older()):
        pass
    assert gguf_cpu.library() is native
