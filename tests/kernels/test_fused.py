"""Fused decoder-layer kernels (Triton; interpreted without CUDA) against torch references, on
fresh random inputs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is first wrapped

from radixlm.kernels import fused  # noqa: E402
from radixlm.srt.models.layers import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def ref_rmsnorm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (7, 4096), (3, 100)])
def test_rmsnorm_and_add_rmsnorm(dtype, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g).to(DEVICE, dtype)
    res = torch.randn(rows, n, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEVICE, dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(
        fused.rmsnorm(x, w, 1e-5), ref_rmsnorm(x, w, 1e-5), atol=tol, rtol=tol
    )
    out, summed = fused.add_rmsnorm(x, res, w, 1e-6)
    torch.testing.assert_close(summed, x + res, atol=0, rtol=0)  # rounded exactly like torch
    torch.testing.assert_close(out, ref_rmsnorm(x + res, w, 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (32, 8, 128)])
def test_rope_split_qkv(dtype, heads, kv_heads, head_dim):
    t = 5
    g = torch.Generator().manual_seed(heads * head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    wide = torch.randn(t, width + 24, generator=g).to(DEVICE, dtype)
    qkv = wide[:, :width]  # strided rows, as a slice of a larger buffer
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None).to(DEVICE)
    positions = torch.tensor([0, 1, 17, 999, 4095], device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    q, k, v = fused.rope_split_qkv(qkv, cos, sin, heads, kv_heads, head_dim)
    q_ref = rope.rotate(qkv[:, : heads * head_dim].float(), (cos.float(), sin.float()))
    k_ref = rope.rotate(
        qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].float(), (cos.float(), sin.float())
    )
    tol = TOL[dtype]
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    torch.testing.assert_close(q.float(), q_ref.flatten(1), atol=tol, rtol=tol)
    torch.testing.assert_close(k.float(), k_ref.flatten(1), atol=tol, rtol=tol)
    torch.testing.assert_close(v, qkv[:, (heads + kv_heads) * head_dim :], atol=0, rtol=0)


def test_rope_matches_the_explicit_rotation_formula():
    """Independent of RotaryEmbedding.rotate: x1*cos - x2*sin, x2*cos + x1*sin per head."""
    t, h, d = 3, 2, 8
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (h + 2) * d, generator=g).to(DEVICE)
    angle = torch.rand(t, d // 2, generator=g).to(DEVICE) * 6
    c, s = angle.cos(), angle.sin()
    q, k, _ = fused.rope_split_qkv(qkv, torch.cat((c, c), -1), torch.cat((-s, s), -1), h, 1, d)
    x = qkv[:, : (h + 1) * d].view(t, h + 1, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    want = torch.cat((x1 * c[:, None] - x2 * s[:, None], x2 * c[:, None] + x1 * s[:, None]), -1)
    torch.testing.assert_close(torch.cat((q, k), 1), want.flatten(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (6, 14336), (2, 7)])
def test_silu_and_mul(dtype, rows, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, 2 * n, generator=g).to(DEVICE, dtype)
    want = (F.silu(x[:, :n].float()) * x[:, n:].float()).to(dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(fused.silu_and_mul(x), want, atol=tol, rtol=tol)


def test_bad_shapes_are_rejected():
    x = torch.randn(4, 10, device=DEVICE)
    with pytest.raises(ValueError, match="columns"):
        fused.rope_split_qkv(x, x, x, 1, 1, 4)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused.rmsnorm(x.t(), torch.ones(4, device=DEVICE), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (32, 4, 128)])
def test_rope_split_qkv_with_per_head_norms(dtype, heads, kv_heads, head_dim):
    """Per-head q/k RMSNorm (Qwen3) fused in front of the rotation: the torch path's RMSNorm of
    each head, then rope; v untouched; the store variant writes the same k."""
    t = 5
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    qkv[0, :head_dim] *= 30.0  # a head far from unit scale: the norm must bite
    qw = (1 + 0.3 * torch.randn(head_dim, generator=g)).to(DEVICE, dtype)
    kw = (1 + 0.3 * torch.randn(head_dim, generator=g)).to(DEVICE, dtype)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None).to(DEVICE)
    positions = torch.tensor([0, 1, 17, 999, 4095], device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    norms = (qw, kw, 1e-6)
    q, k, v = fused.rope_split_qkv(qkv, cos, sin, heads, kv_heads, head_dim, norms=norms)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q_in = qkv[:, :q_size].reshape(t, heads, head_dim)
    k_in = qkv[:, q_size : q_size + kv_size].reshape(t, kv_heads, head_dim)
    cs = (cos.float(), sin.float())
    q_ref = rope.rotate(ref_rmsnorm(q_in, qw, 1e-6).float().flatten(1), cs).flatten(1)
    k_ref = rope.rotate(ref_rmsnorm(k_in, kw, 1e-6).float().flatten(1), cs).flatten(1)
    tol = TOL[dtype]
    torch.testing.assert_close(q.float(), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k.float(), k_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(v, qkv[:, q_size + kv_size :], atol=0, rtol=0)
    plain, _, _ = fused.rope_split_qkv(qkv, cos, sin, heads, kv_heads, head_dim)
    assert not torch.allclose(plain.float(), q_ref, atol=0.1)
    with pytest.raises(ValueError, match="norm weight"):
        fused.rope_split_qkv(qkv, cos, sin, heads, kv_heads, head_dim, norms=(qw[:-1], kw, 1e-6))


def _pool_case(dtype, heads, kv_heads, head_dim, t, num_slots=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None).to(DEVICE)
    positions = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    slots = torch.randperm(num_slots - 1, generator=g)[:t].add(1).to(DEVICE)  # distinct, not 0
    return qkv, cos, sin, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 16)])
def test_rope_qkv_store_writes_the_pool_rows(dtype, heads, kv_heads, head_dim):
    """q as rope_split_qkv returns it; k and v land in the pool rows of their slots, bit for bit
    what rope_split_qkv + KVPool.set_kv store; every other row stays untouched."""
    from radixlm.srt.executor.memory_pool import KVPool

    t = 6
    qkv, cos, sin, slots = _pool_case(dtype, heads, kv_heads, head_dim, t, seed=heads)
    q_ref, k_ref, v_ref = fused.rope_split_qkv(qkv, cos, sin, heads, kv_heads, head_dim)
    ref_pool = KVPool(39, 1, kv_heads, head_dim, dtype, DEVICE)
    ref_pool.set_kv(0, slots, k_ref.view(t, kv_heads, head_dim), v_ref.view(t, kv_heads, head_dim))
    pool = KVPool(39, 1, kv_heads, head_dim, dtype, DEVICE)
    k_buf, v_buf, ks, vs = pool.direct_write_target(0)
    q = fused.rope_qkv_store(
        qkv, cos, sin, heads, kv_heads, head_dim, slots=slots, k_buf=k_buf, v_buf=v_buf
    )
    assert pool.has_written_tokens
    assert torch.equal(q, q_ref)
    assert torch.equal(k_buf, ref_pool.k_buffers[0]) and torch.equal(v_buf, ref_pool.v_buffers[0])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="fp8 stores need a CUDA device")
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_rope_qkv_store_quantises_like_set_kv(fp8, scale):
    """An fp8 pool: the kernel's bytes equal set_kv's (value / scale, saturated, nearest)."""
    from radixlm.srt.executor.memory_pool import KVPool

    heads, kv_heads, head_dim, t = 32, 8, 128, 7
    qkv, cos, sin, slots = _pool_case(torch.bfloat16, heads, kv_heads, head_dim, t, seed=3)
    qkv[0, heads * head_dim :] *= 1e4  # beyond e4m3's range: saturates
    _, k_ref, v_ref = fused.rope_split_qkv(qkv, cos, sin, heads, kv_heads, head_dim)
    args = (39, 1, kv_heads, head_dim, torch.bfloat16, DEVICE, fp8, [scale], [scale / 2])
    ref_pool = KVPool(*args)
    ref_pool.set_kv(0, slots, k_ref.view(t, kv_heads, head_dim), v_ref.view(t, kv_heads, head_dim))
    pool = KVPool(*args)
    k_buf, v_buf, ks, vs = pool.direct_write_target(0)
    assert (ks, vs) == (scale, scale / 2)
    fused.rope_qkv_store(
        qkv,
        cos,
        sin,
        heads,
        kv_heads,
        head_dim,
        slots=slots,
        k_buf=k_buf,
        v_buf=v_buf,
        k_scale=ks,
        v_scale=vs,
    )
    for got, want in ((k_buf, ref_pool.k_buffers[0]), (v_buf, ref_pool.v_buffers[0])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_rope_qkv_store_checks_its_buffers():
    from radixlm.srt.executor.memory_pool import KVPool

    qkv, cos, sin, slots = _pool_case(torch.float32, 4, 2, 16, 3)
    pool = KVPool(39, 1, 2, 16, torch.float32, DEVICE)
    k_buf, v_buf, _, _ = pool.direct_write_target(0)
    with pytest.raises(ValueError, match="v_buf must be a contiguous"):
        fused.rope_qkv_store(qkv, cos, sin, 4, 2, 16, slots=slots, k_buf=k_buf, v_buf=v_buf[:, :1])
    with pytest.raises(ValueError, match="slots must be"):
        fused.rope_qkv_store(qkv, cos, sin, 4, 2, 16, slots=slots[:2], k_buf=k_buf, v_buf=v_buf)
    with pool.recording_amax():  # calibration needs the values to pass through set_kv
        assert pool.direct_write_target(0) is None
