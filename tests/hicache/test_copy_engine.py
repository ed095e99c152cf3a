"""Copy engines: device -> host -> device round trips land bit-identical at new slots; the host
pool holds the documented page layout; CUDA copies match the synchronous ones, record one
event per layer, and are ordered after the compute stream's queued work."""

from __future__ import annotations

import pytest
import torch

from radixlm.hicache.copy_engine import (
    CopyOp,
    CudaCopyEngine,
    SyncCopyEngine,
    make_copy_engine,
)
from radixlm.hicache.host_pool import HostKVPool

LAYERS, HEADS, HEAD_DIM = 3, 2, 8


def make_buffers(num_slots: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """Per-layer K and V buffers [num_slots + 1, HEADS, HEAD_DIM] of distinct random values."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_slots + 1, HEADS, HEAD_DIM)
    k = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(LAYERS)]
    v = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(LAYERS)]
    return k, v


def make_pool(num_pages: int, page_size: int, dtype: torch.dtype, pin: bool = False):
    return HostKVPool(num_pages * page_size, page_size, LAYERS, HEADS, HEAD_DIM, dtype, pin)


def fragmented_alloc(pool: HostKVPool, num_tokens: int) -> torch.Tensor:
    """Host slots whose pages are not consecutive (every other page of the pool is taken)."""
    singles = [pool.alloc(pool.page_size) for _ in range(pool.num_pages)]
    for s in singles[::2]:
        pool.free(s)
    slots = pool.alloc(num_tokens)
    assert slots is not None
    for s in singles[1::2]:
        pool.free(s)
    return slots


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_same_kv(k, v, dst, k_src, v_src, src):
    for layer in range(LAYERS):
        assert torch.equal(as_bits(k[layer][dst]), as_bits(k_src[layer][src]))
        assert torch.equal(as_bits(v[layer][dst]), as_bits(v_src[layer][src]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_round_trip_lands_bit_identical_at_new_slots(dtype, page_size):
    num_slots = 10 * page_size
    num_tokens = 4 * page_size
    k, v = make_buffers(num_slots, dtype)
    k0, v0 = [t.clone() for t in k], [t.clone() for t in v]
    # interleaved, non-contiguous device slots (not page-aligned either)
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(1)) + 1
    src, dst = perm[:num_tokens], perm[num_tokens : 2 * num_tokens]
    pool = make_pool(12, page_size, dtype)
    host = fragmented_alloc(pool, num_tokens)
    engine = SyncCopyEngine()

    write = engine.write(k, v, src, pool, host)
    assert write.done() and write.num_bytes == num_tokens * pool.bytes_per_token
    assert write.seconds is not None and write.seconds > 0
    assert_same_kv(k, v, src, k0, v0, src)  # the source is untouched

    for i, page in enumerate(pool.page_ids(host).tolist()):  # the documented host layout
        for off in range(page_size):
            slot = int(src[i * page_size + off])
            for layer in range(LAYERS):
                assert torch.equal(pool.data[layer, page, 0, off], k[layer][slot])
                assert torch.equal(pool.data[layer, page, 1, off], v[layer][slot])

    load = engine.load(pool, host, k, v, dst)
    assert load.done() and load.num_bytes == write.num_bytes and load.seconds > 0
    assert_same_kv(k, v, dst, k0, v0, src)
    untouched = torch.ones(len(k[0]), dtype=torch.bool)
    untouched[dst] = False
    for layer in range(LAYERS):
        assert torch.equal(k[layer][untouched], k0[layer][untouched])
        assert torch.equal(v[layer][untouched], v0[layer][untouched])


def test_int32_slots_and_host_pages_in_descending_order():
    k, v = make_buffers(32, torch.float32)
    k0, v0 = [t.clone() for t in k], [t.clone() for t in v]
    pool = make_pool(8, 4, torch.float32)
    host = torch.cat([torch.arange(24, 28), torch.arange(4, 8), torch.arange(0, 4)])
    src = torch.arange(9, 21, dtype=torch.int32)
    dst = torch.tensor([30, 2, 25, 4, 5, 6, 7, 8, 1, 22, 23, 24], dtype=torch.int32)
    engine = SyncCopyEngine()
    engine.write(k, v, src, pool, host)
    engine.load(pool, host, k, v, dst)
    assert_same_kv(k, v, dst.long(), k0, v0, src.long())


def test_bad_copies_are_refused():
    k, v = make_buffers(16, torch.float32)
    pool = make_pool(4, 4, torch.float32)
    engine = SyncCopyEngine()
    with pytest.raises(ValueError, match="device slots"):
        engine.write(k, v, torch.arange(1, 5), pool, torch.arange(8))
    with pytest.raises(ValueError, match="whole pages"):
        engine.load(pool, torch.arange(3), k, v, torch.arange(1, 4))
    with pytest.raises(ValueError, match="layers"):
        engine.write(k[:2], v[:2], torch.arange(1, 5), pool, torch.arange(4))
    k16, v16 = make_buffers(16, torch.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        engine.write(k16, v16, torch.arange(1, 5), pool, torch.arange(4))


def test_empty_copy_is_done():
    k, v = make_buffers(8, torch.float32)
    pool = make_pool(2, 4, torch.float32)
    empty = torch.empty(0, dtype=torch.int64)
    op = SyncCopyEngine().write(k, v, empty, pool, empty)
    assert op.done() and op.num_bytes == 0


def test_cpu_picks_the_synchronous_engine():
    pool = make_pool(2, 4, torch.float32)
    assert isinstance(make_copy_engine("cpu", pool), SyncCopyEngine)
    op = CopyOp(10, 0.5)
    assert op.done() and op.seconds == 0.5 and op.layer_events == []
    op.wait()
    op.wait_layer(None, 0)
    op.make_stream_wait()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_engine_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        CudaCopyEngine("cuda")


# ------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("device_index_on_gpu", [False, True])
def test_cuda_round_trip_matches_the_synchronous_engine(dtype, page_size, device_index_on_gpu):
    num_tokens = 8 * page_size
    k, v = make_buffers(24 * page_size, dtype, "cuda")
    k0, v0 = [t.clone() for t in k], [t.clone() for t in v]
    perm = torch.randperm(24 * page_size, generator=torch.Generator().manual_seed(2)) + 1
    src, dst = perm[:num_tokens], perm[-num_tokens:]
    if device_index_on_gpu:
        src, dst = src.cuda(), dst.cuda()
    sync_pool = make_pool(20, page_size, dtype)
    cuda_pool = make_pool(20, page_size, dtype, pin=True)
    assert cuda_pool.is_pinned
    host = fragmented_alloc(sync_pool, num_tokens)
    assert cuda_pool.alloc(cuda_pool.total_size()) is not None  # host slots are just numbers
    # a staging limit of one layer of 3 pages cuts the copy into chunks
    engine = CudaCopyEngine("cuda", max_staging_bytes=3 * cuda_pool.bytes_per_page // LAYERS)
    SyncCopyEngine().write(k, v, src, sync_pool, host)
    write = engine.write(k, v, src, cuda_pool, host)
    write.wait()
    assert write.done() and write.seconds > 0 and write.layer_events == []
    pages = sync_pool.page_ids(host)
    assert torch.equal(as_bits(cuda_pool.data[:, pages]), as_bits(sync_pool.data[:, pages]))
    assert len(engine._chunks(pages.numel(), cuda_pool)) == 3

    load = engine.load(cuda_pool, host, k, v, dst)
    load.make_stream_wait()
    assert_same_kv(k, v, dst, k0, v0, src)
    assert load.done() and load.seconds > 0 and load.num_bytes == write.num_bytes


@pytest.mark.gpu
def test_cuda_load_records_one_event_per_layer():
    k, v = make_buffers(64, torch.bfloat16, "cuda")
    k0, v0 = [t.clone() for t in k], [t.clone() for t in v]
    pool = make_pool(16, 4, torch.bfloat16, pin=True)
    host = pool.alloc(32)
    engine = CudaCopyEngine("cuda")
    engine.write(k, v, torch.arange(1, 33), pool, host).wait()
    load = engine.load(pool, host, k, v, torch.arange(33, 65))
    assert len(load.layer_events) == LAYERS
    consumer = torch.cuda.Stream()
    seen = []
    with torch.cuda.stream(consumer):
        for layer in range(LAYERS):
            load.wait_layer(consumer, layer)
            seen.append(k[layer][33:65].clone())
    consumer.synchronize()
    for layer in range(LAYERS):
        assert load.layer_events[layer].query()
        assert torch.equal(seen[layer], k0[layer][1:33])
    assert_same_kv(k, v, torch.arange(33, 65), k0, v0, torch.arange(1, 33))


@pytest.mark.gpu
@pytest.mark.parametrize("slots_on_gpu", [True, False])
def test_cuda_copies_are_ordered_after_queued_compute(slots_on_gpu):
    device = "cuda" if slots_on_gpu else "cpu"
    k, v = make_buffers(64, torch.float32, "cuda")
    pool = make_pool(16, 4, torch.float32, pin=True)
    host = pool.alloc(16)
    engine = CudaCopyEngine("cuda")
    src, dst = torch.arange(1, 17, device=device), torch.arange(33, 49, device=device)
    engine.write(k, v, src, pool, host).wait()  # first copies allocate staging: may sync
    engine.load(pool, host, k, v, dst).wait()
    torch.zeros(1, device="cuda").fill_(1.0)  # (a kernel's first launch loads it: may sync)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the compute stream is busy, then writes the KV
    for layer in range(LAYERS):
        k[layer][1:17].fill_(7.0)
    write = engine.write(k, v, src, pool, host)
    assert not write.done() and write.seconds is None  # still behind the sleep
    write.wait()
    assert write.done() and write.seconds is not None
    assert bool((pool.data[:, :4, 0] == 7.0).all())

    # a load waits for queued readers of the slots it overwrites
    expected = k[0][33:49].clone()
    pool.data[:, :4].fill_(-1.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    before = k[0][33:49].clone()  # queued behind the sleep
    load = engine.load(pool, host, k, v, dst)
    assert not load.done()
    load.make_stream_wait()
    assert torch.equal(before, expected)
    assert bool((k[0][33:49] == -1.0).all())
