"""The CPU kernels (``kernels/cpu_decode.py``) and the cpu attention backend against the torch
reference: paged decode batches of varied lengths, GQA, page sizes, windows, float32/bfloat16."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels import cpu_decode
from radixlm.kernels.attention import registry
from radixlm.kernels.attention.cpu_backend import CpuAttentionBackend
from radixlm.kernels.attention.torch_backend import TorchAttentionBackend
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.memory_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from radixlm.srt.models.layers import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not cpu_decode.available(), reason="the CPU kernels could not be built (no C++ compiler)"
)


@dataclass
class Layer:
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    logit_cap: float = 0.0


def decode_case(seq_lens, heads, kv_heads, head_dim=64, page_size=1, dtype=torch.float32, seed=0):
    """A decode batch over scattered pages: each request's prefix is allocated interleaved with
    the others' and with freed junk, its new token on its last page (``alloc_for``)."""
    gen = torch.Generator().manual_seed(seed)
    pool_tokens = 4 * (sum(seq_lens) + 8 * page_size * (len(seq_lens) + 3))
    alloc = TokenSlotAllocator(pool_tokens, page_size, torch.device("cpu"))
    junk = alloc.alloc(2 * page_size + 1)
    prefix = [alloc.alloc(n - 1) if n > 1 else torch.empty(0, dtype=torch.int64) for n in seq_lens]
    alloc.free(junk)
    new = [
        alloc.alloc_for(1, last_slot=int(p[-1]) if len(p) else 0, used_len=len(p)) for p in prefix
    ]
    kv_pool = KVPool(pool_tokens, 2, kv_heads, head_dim, dtype, torch.device("cpu"))
    for buf in (*kv_pool.k_buffers, *kv_pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=gen))
    r2t = ReqToTokenPool(len(seq_lens) + 4, max(seq_lens) + 5, torch.device("cpu"))
    req_slots = torch.randperm(r2t.num_req_slots, generator=gen)[: len(seq_lens)] + 1
    for slot, pre, nw in zip(req_slots.tolist(), prefix, new, strict=True):
        r2t.write(slot, 0, torch.cat([pre, nw]))
    fb = ForwardBatch.from_host(
        ForwardMode.DECODE,
        torch.zeros(len(seq_lens), dtype=torch.int64),
        [n - 1 for n in seq_lens],
        torch.cat(new),
        req_slots.tolist(),
        [n - 1 for n in seq_lens],
        [1] * len(seq_lens),
        req_to_token_pool=r2t,
        kv_pool=kv_pool,
        attn_backend=None,
    )
    b = len(seq_lens)
    # q, k, v as the model hands them over: row-strided views of one qkv tensor
    qkv = torch.randn((b, (heads + 2 * kv_heads) * head_dim), generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return fb, Layer(1, heads, kv_heads, head_dim, head_dim**-0.5), q, k, v


def run(backend, fb, layer, q, k, v):
    backend.plan(fb)
    out = backend.forward(q, k, v, layer, fb)
    k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
    return out, k_buf.clone(), v_buf.clone()


def compare(fb, layer, q, k, v, tol):
    """The cpu backend against the torch one on copies of the same pool."""
    pools = [fb.kv_pool.k_buffers[1].clone(), fb.kv_pool.v_buffers[1].clone()]
    ref, ref_k, ref_v = run(TorchAttentionBackend(), fb, layer, q, k, v)
    fb.kv_pool.k_buffers[1].copy_(pools[0])
    fb.kv_pool.v_buffers[1].copy_(pools[1])
    out, out_k, out_v = run(CpuAttentionBackend(), fb, layer, q, k, v)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol}"
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)  # the new K/V, stored alike


@pytest.mark.parametrize(
    "seq_lens,heads,kv_heads,page_size",
    [
        ([1], 4, 4, 1),
        ([17], 9, 3, 1),
        ([5, 300, 37, 128, 1, 64], 9, 3, 1),
        ([33, 200, 7, 90], 8, 2, 16),
        ([129, 3, 64], 4, 1, 4),
        ([70] * 16, 8, 8, 8),
    ],
)
def test_decode_matches_the_torch_backend(seq_lens, heads, kv_heads, page_size):
    fb, layer, q, k, v = decode_case(seq_lens, heads, kv_heads, page_size=page_size)
    compare(fb, layer, q, k, v, tol=2e-6)


def test_decode_bfloat16_and_head_dim_128():
    fb, layer, q, k, v = decode_case([40, 260, 9], 8, 2, 128, 4, torch.bfloat16, seed=3)
    compare(fb, layer, q, k, v, tol=2e-2)  # bf16 outputs: one rounding apart at most


@pytest.mark.parametrize("head_dim", [8, 72, 96, 128, 256, 60])
def test_decode_float32_head_dims(head_dim):
    """float32 items take the vector path where head_dim is a multiple of 8 (V summed 64 dims
    at a time: 1-8 vectors a piece), the plain loops otherwise (60)."""
    fb, layer, q, k, v = decode_case([1, 9, 130, 33], 8, 2, head_dim, 4, seed=head_dim)
    compare(fb, layer, q, k, v, tol=2e-6)


def test_decode_float32_peaked_scores():
    """Scores far apart (most weights underflow to 0): the same outputs to rounding."""
    fb, layer, q, k, v = decode_case([3, 77, 200], 4, 1, seed=11)
    compare(fb, layer, q * 40.0, k, v, tol=1e-5)  # a few ulps of outputs up to about 4


@pytest.mark.parametrize("window", [1, 8, 100])
def test_decode_sliding_window(window):
    fb, layer, q, k, v = decode_case([5, 50, 300], 6, 2, page_size=4, seed=window)
    layer.sliding_window = window
    compare(fb, layer, q, k, v, tol=2e-6)


def test_soft_capped_layer_and_fp8_pool_take_the_torch_path():
    fb, layer, q, k, v = decode_case([20, 45], 4, 2, seed=5)
    layer.logit_cap = 30.0
    backend = CpuAttentionBackend()
    backend.plan(fb)
    assert not backend.serves(q, layer, fb)
    compare(fb, layer, q, k, v, tol=0.0)  # the inherited path itself
    layer.logit_cap = 0.0
    fb.kv_pool = KVPool(fb.kv_pool.max_total_tokens, 2, 2, 64, torch.float32, "cpu",
                        storage_dtype=torch.float8_e4m3fn)  # fmt: skip
    assert not backend.serves(q, layer, fb)


def test_disabled_kernels_give_the_torch_path():
    fb, layer, q, k, v = decode_case([20, 45], 4, 2, seed=6)
    with cpu_decode.disabled():
        assert not cpu_decode.available()
        backend = CpuAttentionBackend()
        backend.plan(fb)
        assert not backend.serves(q, layer, fb)
        assert registry.resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert cpu_decode.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_equals_the_torch_rotation(dtype):
    heads, kv_heads, d = 9, 3, 64
    rotary = RotaryEmbedding(d, 512, 10000.0, None)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d).to(dtype)
    cos_sin = rotary.cos_sin(torch.tensor([0, 1, 7, 200, 511]), dtype)
    expected = rotary.rotate(qkv[:, : (heads + kv_heads) * d], cos_sin).flatten(1)
    out = qkv.clone()
    cpu_decode.rope_inplace(out, heads + kv_heads, d, *cos_sin)
    assert torch.equal(out[:, : (heads + kv_heads) * d], expected)  # bit for bit
    assert torch.equal(out[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])


def test_index_tensors_must_be_int64_on_the_cpu():
    table = torch.zeros(3, 8, dtype=torch.int64)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        cpu_decode.DecodeBatch(table, one.int(), one, one)


@pytest.mark.parametrize(
    "rows,d", [(1, 576), (3, 64), (17, 100), (300, 576), (5, 7), (2, 3), (1, 4096), (2, 70000)]
)
def test_rmsnorm_matches_torch(rows, d):
    """Bit for bit: the sum of squares in torch's order (scalar path below 8 columns, vectors
    and a tail above, cascade levels past 64 vectors of 4)."""
    gen = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, d, generator=gen) * 3, torch.randn(rows, d, generator=gen)
    w = torch.randn(d, generator=gen)
    out, summed = cpu_decode.rmsnorm(x, w, 1e-6, res)
    assert torch.equal(summed, x + res)
    assert torch.equal(out, torch.rms_norm(x + res, (d,), w, 1e-6))
    out, same = cpu_decode.rmsnorm(x, w, 1e-6)
    assert same is x
    assert torch.equal(out, torch.rms_norm(x, (d,), w, 1e-6))


def test_rmsnorm_layer_takes_the_kernel_for_float32_rows():
    from radixlm.srt.models.layers import RMSNorm

    norm = RMSNorm(64, 1e-5)
    norm.weight.data.copy_(torch.linspace(0.5, 2, 64))
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    assert cpu_decode.serves_norm(x) and not cpu_decode.serves_norm(x.t())
    out, summed = norm.add_and_norm(x, res)
    with cpu_decode.disabled():  # the torch path
        ref, ref_sum = norm.add_and_norm(x, res)
    assert torch.equal(summed, ref_sum)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(norm(x), torch.rms_norm(x, (64,), norm.weight, 1e-5))


@pytest.mark.parametrize("rows,n", [(1, 1536), (3, 7), (40, 2048), (1, 16), (2, 40), (3, 1000)])
def test_silu_and_mul_matches_torch(rows, n):
    """Bit for bit: SLEEF's exp over torch's vector steps, the C library's on each row's rest."""
    x = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n)) * 4
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(cpu_decode.silu_and_mul(x), F.silu(gate) * up)


def test_silu_matches_torch_over_the_float_range():
    gate = torch.cat([torch.linspace(-120, 120, 400_000), torch.tensor([0.0, -0.0, 88.7, -88.7])])
    x = torch.cat([gate, torch.ones_like(gate)]).reshape(1, -1)
    assert torch.equal(cpu_decode.silu_and_mul(x)[0], F.silu(gate))
