"""An fp8 device KV pool through the host tier: its bytes travel as uint8 views
(``KVPool.transfer_buffers``) into a host pool of ``KVPool.transfer_dtype``, and a page comes
back bit-exact at new device slots, through the host pool and through a page payload (the disk
tier's unit)."""

from __future__ import annotations

import pytest
import torch

from radixlm.hicache.controller import HiCacheController
from radixlm.hicache.copy_engine import CudaCopyEngine, SyncCopyEngine
from radixlm.hicache.host_pool import HostKVPool
from radixlm.srt.executor.memory_pool import KVPool

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4


def filled_pool(fp8: torch.dtype, device: str, num_slots: int = 40) -> KVPool:
    """An fp8 pool with random K/V in every slot, a few beyond the format's range (saturated)."""
    pool = KVPool(num_slots, LAYERS, HEADS, HEAD_DIM, torch.bfloat16, torch.device(device), fp8)
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(1, num_slots + 1, device=device)
    for layer in range(LAYERS):
        k, v = (torch.randn(num_slots, HEADS, HEAD_DIM, generator=gen) * 100 for _ in range(2))
        k[0, 0, 0] = 1e9  # saturates
        pool.set_kv(layer, slots, k.to(device, torch.bfloat16), v.to(device, torch.bfloat16))
    return pool


def host_pool_for(pool: KVPool, num_pages: int, pin: bool = False) -> HostKVPool:
    return HostKVPool(
        num_pages * PAGE, PAGE, LAYERS, HEADS, HEAD_DIM, pool.transfer_dtype, pin_memory=pin
    )


def assert_same_bytes(dst: KVPool, dst_slots, src: KVPool, src_slots) -> None:
    for layer in range(LAYERS):
        for d, s in zip(dst.get_kv(layer), src.get_kv(layer), strict=True):
            assert d.dtype == s.dtype == src.storage_dtype
            assert torch.equal(d.view(torch.uint8)[dst_slots], s.view(torch.uint8)[src_slots])


def round_trip(fp8: torch.dtype, device: str, engine, pin: bool = False) -> None:
    src = filled_pool(fp8, device)
    host = host_pool_for(src, 4, pin)
    assert host.bytes_per_token * 2 == KVPool.bytes_per_token(
        LAYERS, HEADS, HEAD_DIM, torch.bfloat16
    )
    HiCacheController(*src.transfer_buffers(), host, engine)  # accepts the buffers
    src_slots = torch.arange(5, 5 + 2 * PAGE, device=device)  # two pages' worth
    host_slots = host.alloc(2 * PAGE)
    engine.write(*src.transfer_buffers(), src_slots, host, host_slots).wait()

    # through a page payload into a second host pool (what the disk tier stores and reads)
    host2 = host_pool_for(src, 4, pin)
    host2_slots = host2.alloc(2 * PAGE)
    for a, b in zip(host.page_ids(host_slots), host2.page_ids(host2_slots), strict=True):
        host2.write_page_bytes(int(b), host.page_bytes(int(a)))

    dst = KVPool(40, LAYERS, HEADS, HEAD_DIM, torch.bfloat16, torch.device(device), fp8)
    dst_slots = torch.arange(21, 21 + 2 * PAGE, device=device)
    engine.load(host2, host2_slots, *dst.transfer_buffers(), dst_slots).wait()
    assert_same_bytes(dst, dst_slots, src, src_slots)
    assert dst.get_kv(0)[0].view(torch.uint8)[1:21].eq(0).all()  # nothing else was written


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pages_round_trip_bit_exact(fp8):
    round_trip(fp8, "cpu", SyncCopyEngine())


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pages_round_trip_bit_exact_cuda(fp8):
    round_trip(fp8, "cuda", CudaCopyEngine(torch.device("cuda")), pin=True)


def test_unquantised_pool_transfers_as_is():
    pool = KVPool(8, 1, 1, 4, torch.bfloat16, torch.device("cpu"))
    k, v = pool.transfer_buffers()
    assert pool.transfer_dtype == torch.bfloat16 and k[0] is pool.k_buffers[0]
