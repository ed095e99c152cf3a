"""Attention over an FP8 KV pool (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``).

CPU: the pool's quantisation (range, saturation, scales), the torch backend (it dequantises only
the rows it gathers) and the Triton kernels under the interpreter. GPU (``gpu``): Triton and
FlashInfer compiled in bf16, and a CUDA-graph replay over an fp8 pool.

Error bounds. Round-to-nearest into a format with m mantissa bits moves a value of the normal
range by at most 2^-(m+1) of it: 2^-4 for e4m3 (m = 3), 2^-3 for e5m2 (m = 2); below the normal
range by at most half the smallest subnormal (2^-10 for e4m3, 2^-17 for e5m2), times the scale
(``test_quantise_error_per_element``). Two attention checks follow from it:

- exact: the fp8 pool must give what the same backend gives over a full-precision pool holding
  the dequantised values (1e-5 in fp32 on the CPU; 1e-4 fp32 / 2e-2 bf16 for the kernels, the
  tolerances of the full-precision kernel tests). This is where a missing or wrong scale shows.
- against full-precision KV: the output is a softmax-weighted mean of V rows, so V's error
  moves it by at most ``REL * max|v|``; K's error perturbs the logits, which adds a term of the
  same order for these inputs (unit-normal q, k, v, head_dim 64, scaling 1/8). Measured: about
  half of ``REL * max|v|``; asserted: at most ``REL * max|v|`` (bf16 kernels: plus 2e-2).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixlm.kernels.attention.torch_backend import TorchAttentionBackend
from radixlm.kernels.attention.triton_backend import TritonAttentionBackend
from radixlm.srt.executor.memory_pool import KVPool, quantize_fp8
from tests.kernels.test_attention_backends import (
    DEVICE,
    LLAMA_8B_HEADS,
    Case,
    _grow_by_one,
    decode_lens,
    make_case,
    run_backend,
)

CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
REL_ERROR = {E4M3: 2**-4, E5M2: 2**-3}  # half an ulp of a 3- / 2-bit mantissa
SUBNORMAL_ERROR = {E4M3: 2**-10, E5M2: 2**-17}  # half the smallest subnormal (scale 1)
DECODE = ([8, 40, 0, 77], [1, 1, 1, 1])  # prefix lens, extend lens
EXTEND = ([0, 13, 30], [21, 7, 1])


def dequantise(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    return quantize_fp8(x, scale, fp8).to(torch.float32) * scale


def fp8_pair(case: Case, fp8: torch.dtype, k_scale: float, v_scale: float) -> tuple[Case, Case]:
    """(the case over an fp8 pool holding the case's pool quantised; the case over a pool of the
    case's dtype holding those values dequantised, with its new k/v dequantised too)."""
    src = case.fb.kv_pool
    n, heads, dim = src.k_buffers[0].shape
    layers, device = src.num_layers, src.k_buffers[0].device
    ks, vs = [k_scale] * layers, [v_scale] * layers
    fp8_pool = KVPool(n - 1, layers, heads, dim, src.dtype, device, fp8, ks, vs)
    deq_pool = KVPool(n - 1, layers, heads, dim, src.dtype, device)
    for name, scale in (("k_buffers", k_scale), ("v_buffers", v_scale)):
        layers_of = (getattr(src, name), getattr(fp8_pool, name), getattr(deq_pool, name))
        for s, q8, dq in zip(*layers_of, strict=True):
            q8.view(torch.uint8).copy_(quantize_fp8(s, scale, fp8).view(torch.uint8))
            dq.copy_(dequantise(s, scale, fp8))
    fp8_case = dataclasses.replace(case, fb=dataclasses.replace(case.fb, kv_pool=fp8_pool))
    deq_case = Case(
        dataclasses.replace(case.fb, kv_pool=deq_pool),
        case.layer,
        case.q,
        dequantise(case.k, k_scale, fp8).to(case.k.dtype),
        dequantise(case.v, v_scale, fp8).to(case.v.dtype),
    )
    return fp8_case, deq_case


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and bool(torch.isfinite(out).all())
    return (out.float() - ref.float()).abs().max().item()


def max_abs_v(case: Case) -> float:
    pool_max = max(b.float().abs().max().item() for b in case.fb.kv_pool.v_buffers)
    return max(case.v.float().abs().max().item(), pool_max)


# ------------------------------------------------------------------- quantisation (CPU)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_quantise_error_per_element(fp8, scale):
    finite_max = torch.finfo(fp8).max * scale
    x = torch.cat(
        [
            torch.logspace(-12, 0, 4001, base=2.0) * finite_max,  # every binade, subnormals too
            torch.randn(4000, generator=torch.Generator().manual_seed(0)) * scale,
        ]
    )
    x = torch.cat([x, -x])
    err = (dequantise(x, scale, fp8) - x).abs()
    bound = torch.maximum(REL_ERROR[fp8] * x.abs(), torch.tensor(SUBNORMAL_ERROR[fp8] * scale))
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_writes_saturate_instead_of_overflowing(fp8):
    pool = KVPool(8, 1, 1, 4, torch.float32, CPU, fp8)
    huge = torch.tensor([[[1e6, -1e30, float("inf"), float("-inf")]]])
    pool.set_kv(0, torch.tensor([3]), huge, huge)
    finite_max = torch.finfo(fp8).max
    for buf in pool.get_kv(0):
        assert buf[3].float().tolist() == [[finite_max, -finite_max, finite_max, -finite_max]]


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("decode", [False, True])
def test_torch_backend_over_saturated_kv_is_finite(fp8, decode):
    case = make_case(
        *(DECODE if decode else EXTEND), heads=8, kv_heads=2, decode=decode, device=CPU
    )
    fp8_case, _ = fp8_pair(case, fp8, 1.0, 1.0)
    big = dataclasses.replace(fp8_case, k=case.k * 1e5, v=case.v * 1e5)  # beyond either range
    out = run_backend(TorchAttentionBackend(), big)
    assert bool(torch.isfinite(out).all())
    assert out.abs().max().item() <= torch.finfo(fp8).max * 1.001  # a mean of saturated rows


def test_scales_round_trip():
    """Stored value * scale gives the value back (within the format's error); a scale of 4 holds
    values a scale of 1 saturates; each layer keeps its own scales."""
    pool = KVPool(16, 2, 2, 4, torch.float32, CPU, E4M3, k_scales=[4.0, 0.5], v_scales=[2.0, 1.0])
    assert pool.get_scales(0) == (4.0, 2.0) and pool.get_scales(1) == (0.5, 1.0)
    assert pool.is_quantized and pool.storage_dtype == E4M3 and pool.dtype == torch.float32
    x = torch.linspace(-1700.0, 1700.0, 16).view(2, 2, 4)
    slots = torch.tensor([5, 9])
    pool.set_kv(0, slots, x, x / 2)
    k_buf, v_buf = pool.get_kv(0)
    k_back = k_buf[slots].float() * 4.0
    v_back = v_buf[slots].float() * 2.0
    assert bool(((k_back - x).abs() <= REL_ERROR[E4M3] * x.abs()).all())
    assert bool(((v_back - x / 2).abs() <= REL_ERROR[E4M3] * x.abs() / 2).all())
    pool.set_kv(1, slots, x, x)  # k scale 0.5: |x| / 0.5 > 448 saturates
    assert pool.get_kv(1)[0][slots].float().abs().max().item() == 448.0
    assert pool.get_kv(1)[0].float().abs().max().item() * 0.5 == 224.0


def test_pool_bytes_and_bad_scales():
    full = KVPool.bytes_per_token(4, 2, 64, torch.bfloat16)
    assert KVPool.bytes_per_token(4, 2, 64, E4M3) * 2 == full == 2 * 4 * 2 * 64 * 2
    with pytest.raises(ValueError, match="k_scales has 1 entries for 2 layers"):
        KVPool(8, 2, 1, 4, torch.float32, CPU, E4M3, k_scales=[1.0])
    with pytest.raises(ValueError, match="v_scales must be finite and > 0"):
        KVPool(8, 1, 1, 4, torch.float32, CPU, E5M2, v_scales=[0.0])
    with pytest.raises(ValueError, match="need an fp8 KV storage dtype"):
        KVPool(8, 1, 1, 4, torch.float32, CPU, k_scales=[2.0])


# ------------------------------------------------------------------- torch backend (CPU)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 4.0)])
def test_torch_backend_fp8(fp8, decode, scales):
    lens = DECODE if decode else EXTEND
    case = make_case(*lens, heads=8, kv_heads=2, page_size=4, decode=decode, seed=3, device=CPU)
    fp8_case, deq_case = fp8_pair(case, fp8, *scales)
    vmax = max_abs_v(case)
    full = run_backend(TorchAttentionBackend(), case)
    out = run_backend(TorchAttentionBackend(), fp8_case)
    assert max_error(out, run_backend(TorchAttentionBackend(), deq_case)) <= 1e-5
    assert max_error(out, full) <= REL_ERROR[fp8] * vmax
    # the new tokens' K/V were stored quantised with the layer's scales
    k_buf, v_buf = fp8_case.fb.kv_pool.get_kv(0)
    slots = case.fb.out_kv_slots
    k_new = quantize_fp8(case.k.view(-1, 2, 64), scales[0], fp8)
    assert torch.equal(k_buf[slots].view(torch.uint8), k_new.view(torch.uint8))
    v_new = quantize_fp8(case.v.view(-1, 2, 64), scales[1], fp8)
    assert torch.equal(v_buf[slots].view(torch.uint8), v_new.view(torch.uint8))


# ---------------------------------------------- Triton (interpreter on CPU, compiled on GPU)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("decode", [False, True])
def test_triton_fp8_matches_torch_fp8(fp8, decode):
    lens = DECODE if decode else EXTEND
    case = make_case(*lens, heads=8, kv_heads=2, page_size=2, decode=decode, seed=4)
    fp8_case, _ = fp8_pair(case, fp8, 0.5, 2.0)
    ref = run_backend(TorchAttentionBackend(), fp8_pair(case, fp8, 0.5, 2.0)[0])
    out = run_backend(TritonAttentionBackend(num_kv_splits=3 if decode else None), fp8_case)
    assert max_error(out, ref) <= 1e-4
    assert max_error(out, run_backend(TorchAttentionBackend(), case)) <= REL_ERROR[fp8] * max_abs_v(
        case
    )


# ---------------------------------------------------------------- GPU only ------------------


def _gpu_backends(case: Case, page_size: int) -> dict:
    from radixlm.kernels.attention.registry import flashinfer_available

    backends = {"triton": TritonAttentionBackend()}
    if flashinfer_available():
        from radixlm.kernels.attention.flashinfer_backend import FlashInferAttentionBackend

        layer = case.layer
        backends["flashinfer"] = FlashInferAttentionBackend(
            DEVICE,
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            page_size=page_size,
        )
    return backends


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("decode", [False, True])
def test_gpu_backends_fp8(decode, scales, page_size, fp8):
    """bf16 compute over an fp8 pool: against the torch backend on the same fp8 pool (2e-2, the
    bf16 tolerance of the full-precision kernel tests) and on bf16 KV (REL * max|v| + 2e-2)."""
    if decode:
        seq_lens = [1, 33, 517, 1200, 64, 250]
        lens = decode_lens(seq_lens)
    else:
        lens = ([0, 100, 37, 0, 600], [300, 1, 77, 5, 129])
    case = make_case(
        *lens,
        heads=32,
        kv_heads=8,
        head_dim=128,
        page_size=page_size,
        dtype=torch.bfloat16,
        decode=decode,
        seed=page_size,
    )
    ref_fp8 = run_backend(TorchAttentionBackend(), fp8_pair(case, fp8, *scales)[0]).float()
    ref_bf16 = run_backend(TorchAttentionBackend(), case).float()
    loose = REL_ERROR[fp8] * max_abs_v(case) + 2e-2
    for name, backend in _gpu_backends(case, page_size).items():
        fp8_case, _ = fp8_pair(case, fp8, *scales)
        out = run_backend(backend, fp8_case)
        assert out.dtype == torch.bfloat16, name
        assert max_error(out, ref_fp8) <= 2e-2, name
        assert max_error(out, ref_bf16) <= loose, name


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_fp8_decode_replays_in_cuda_graph(page_size):
    """Capture a decode step over an fp8 pool with non-unit scales, grow every sequence by one
    token and replay: the output follows the new lengths and still carries the scales."""
    seq_lens = [5, 40, 301]
    base = make_case(
        *decode_lens(seq_lens),
        **LLAMA_8B_HEADS,
        page_size=page_size,
        dtype=torch.bfloat16,
        decode=True,
        seed=7,
    )
    for backend in _gpu_backends(base, page_size).values():
        case, _ = fp8_pair(base, E4M3, 0.5, 2.0)
        fb = case.fb
        backend.init_cuda_graph_state(max_batch_size=8, max_num_tokens=fb.kv_pool.max_total_tokens)
        backend.plan_for_capture(fb)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            backend.forward(case.q, case.k, case.v, case.layer, fb)  # warm-up (compiles)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = backend.forward(case.q, case.k, case.v, case.layer, fb)
        _grow_by_one(case, page_size)
        backend.plan_for_replay(fb)
        graph.replay()
        torch.cuda.synchronize()
        ref = run_backend(TorchAttentionBackend(), case).float()
        assert max_error(static_out, ref) <= 2e-2


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_fp8_half_dot_path(fp8, num_splits):
    """``FP8_DOT=2`` (a variant decode_tiles times; the default is 0): fp8 tiles converted to
    float16 and both dots in float16, q pre-scaled. Same result as the float32 path and the dequantised reference
    within bf16 output rounding; a q beyond float16's range saturates instead of turning inf."""
    from radixlm.kernels.attention import triton_decode as td

    gen = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, dim, n = 3, 8, 2, 64, 37
    slots = batch * n + 1
    req_to_token = torch.zeros(batch + 1, n, dtype=torch.int64)
    req_to_token[:batch] = (torch.randperm(slots - 1, generator=gen) + 1).view(batch, n)
    seq_lens = torch.tensor([37, 5, 20])
    q = torch.randn(batch, heads * dim, generator=gen).to(DEVICE, torch.bfloat16)
    k = (torch.randn(slots, kv_heads, dim, generator=gen) * 2).to(fp8)
    v = torch.randn(slots, kv_heads, dim, generator=gen).to(fp8)
    table = [t.to(DEVICE) for t in (req_to_token, torch.arange(batch), seq_lens)]
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, scaling=dim**-0.5)
    kw.update(k_scale=0.5, v_scale=2.0, num_splits=num_splits)
    half = {"UPCAST": False, "FP8_DOT": 2}
    out = td.decode_attention(q, k.to(DEVICE), v.to(DEVICE), *table, tiles=half, **kw)
    base = td.decode_attention(q, k.to(DEVICE), v.to(DEVICE), *table, **kw)
    assert out.dtype == torch.bfloat16
    assert max_error(out.float(), base.float()) <= 2e-2

    kf, vf = k.float() * 0.5, v.float() * 2.0
    for i in range(batch):
        rows = req_to_token[i, : seq_lens[i]]
        qi = q[i].float().cpu().view(kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("hgd,nhd->hgn", qi, kf[rows]) * dim**-0.5
        ref = torch.einsum("hgn,nhd->hgd", scores.softmax(-1), vf[rows]).reshape(-1)
        assert (out[i].float().cpu() - ref).abs().max() <= 2e-2 * max(1.0, ref.abs().max())

    huge = q * 1e6  # q * scale far above 65504
    out = td.decode_attention(huge, k.to(DEVICE), v.to(DEVICE), *table, tiles=half, **kw)
    assert torch.isfinite(out.float()).all()
