"""HostKVPool: page layout, alloc/free accounting against a brute-force model, double frees,
raw page bytes, sizing from a byte budget, refusal of impossible sizes."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import radixlm.hicache.host_pool as host_pool_module
from radixlm.hicache.host_pool import HostKVPool

LAYERS, HEADS, HEAD_DIM = 3, 2, 4


def make_pool(num_tokens: int, page_size: int, dtype: torch.dtype = torch.float32) -> HostKVPool:
    return HostKVPool(num_tokens, page_size, LAYERS, HEADS, HEAD_DIM, dtype)


def test_geometry_and_rounding_to_whole_pages():
    pool = make_pool(num_tokens=37, page_size=4, dtype=torch.bfloat16)
    assert pool.num_pages == 9 and pool.total_size() == 36
    assert pool.data.shape == (LAYERS, 9, 2, 4, HEADS, HEAD_DIM)  # layer-major
    assert pool.data.dtype == torch.bfloat16 and pool.data.device.type == "cpu"
    assert pool.bytes_per_token == 2 * LAYERS * HEADS * HEAD_DIM * 2
    assert pool.bytes_per_page == 4 * pool.bytes_per_token
    assert pool.data[0, 3:6].is_contiguous()  # a layer of a run of pages is one block
    assert pool.page_kv(2).shape == (LAYERS, 2, 4, HEADS, HEAD_DIM)
    assert [b.nbytes for b in pool.page_blocks(2)] == [pool.bytes_per_page // LAYERS] * LAYERS
    assert not pool.is_pinned
    assert pool.available_size() == 36 and pool.used_size() == 0


def test_less_than_one_page_is_refused():
    with pytest.raises(ValueError, match="num_tokens"):
        make_pool(num_tokens=3, page_size=4)


def test_more_than_available_ram_is_refused(monkeypatch):
    fake = SimpleNamespace(available=1000)
    monkeypatch.setattr(host_pool_module.psutil, "virtual_memory", lambda: fake)
    with pytest.raises(ValueError, match="GiB"):
        make_pool(num_tokens=1024, page_size=4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinning_without_cuda_is_refused():
    with pytest.raises(ValueError, match="pin_memory"):
        HostKVPool(8, 4, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=True)


def test_alloc_returns_whole_fresh_pages_in_order():
    pool = make_pool(num_tokens=16, page_size=4)
    slots = pool.alloc(8)
    assert slots is not None and slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert slots.tolist() == list(range(8))
    assert pool.page_ids(slots).tolist() == [0, 1]
    assert pool.used_size() == 8 and pool.available_size() == 8
    with pytest.raises(ValueError, match="multiple of page_size"):
        pool.alloc(3)
    assert pool.alloc(12) is None  # all or nothing
    assert pool.available_size() == 8
    assert pool.alloc(0).numel() == 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_alloc_free_matches_a_set_of_free_pages(page_size, seed):
    rng = random.Random(seed)
    num_pages = 24
    pool = make_pool(num_tokens=num_pages * page_size, page_size=page_size)
    free_pages = set(range(num_pages))  # the reference model
    held: list[torch.Tensor] = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            slots = held.pop(rng.randrange(len(held)))
            pool.free(slots)
            free_pages |= set((slots // page_size).tolist())
        else:
            want = rng.randint(0, 6)
            slots = pool.alloc(want * page_size)
            if want > len(free_pages):
                assert slots is None
            else:
                assert slots is not None and slots.numel() == want * page_size
                pages = set(pool.page_ids(slots).tolist())
                assert len(pages) == want and pages <= free_pages
                free_pages -= pages
                held.append(slots)
        assert pool.available_size() == len(free_pages) * page_size
        assert pool.used_size() == (num_pages - len(free_pages)) * page_size
        pool.check_integrity()
    for slots in held:
        pool.free(slots)
    assert pool.available_size() == pool.total_size()
    pool.check_integrity()


def test_double_free_is_detected():
    pool = make_pool(num_tokens=16, page_size=4)
    slots = pool.alloc(8)
    pool.free(slots[4:])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(slots)  # page 1 is already free
    assert pool.used_size() == 4  # the failed free changed nothing
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(torch.cat([slots[:4], slots[:4]]))  # one page twice in one call
    never_allocated = torch.arange(12, 16)
    with pytest.raises(AssertionError):
        pool.free(never_allocated)
    pool.check_integrity()


def test_page_ids_refuses_partial_or_shuffled_pages():
    pool = make_pool(num_tokens=16, page_size=4)
    assert pool.page_ids(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])).tolist() == [2, 0]
    with pytest.raises(ValueError, match="whole pages"):
        pool.page_ids(torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="whole pages"):
        pool.page_ids(torch.tensor([1, 0, 2, 3]))
    with pytest.raises(ValueError, match="outside"):
        pool.page_ids(torch.arange(16, 20))


def test_check_integrity_catches_a_corrupted_free_list():
    pool = make_pool(num_tokens=16, page_size=4)
    pool.alloc(4)
    pool._free_pages.append(pool._free_pages[0])
    with pytest.raises(AssertionError):
        pool.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_page_bytes_round_trip(dtype):
    pool = make_pool(num_tokens=12, page_size=4, dtype=dtype)
    pool.data.copy_(torch.randn(pool.data.shape).to(dtype))
    payload = pool.page_bytes(1)
    assert isinstance(payload, bytes) and len(payload) == pool.bytes_per_page
    # the payload is [layers, 2, page_size, heads, head_dim]: the disk format of every layout
    assert payload == pool.data[:, 1].contiguous().view(torch.uint8).numpy().tobytes()
    other = make_pool(num_tokens=12, page_size=4, dtype=dtype)
    other.data.zero_()
    other.write_page_bytes(2, payload)
    assert torch.equal(other.page_kv(2).view(torch.uint8), pool.page_kv(1).view(torch.uint8))
    assert not other.page_kv(0).any() and not other.page_kv(1).any()
    other.write_page_bytes(0, bytearray(payload))  # any bytes-like payload
    assert other.page_bytes(0) == payload
    with pytest.raises(ValueError, match="bytes"):
        other.write_page_bytes(0, payload[:-1])
    with pytest.raises(ValueError, match="outside"):
        other.page_bytes(3)


def test_page_bytes_is_a_copy():
    pool = make_pool(num_tokens=4, page_size=4)
    pool.data.fill_(1.0)
    payload = pool.page_bytes(0)
    pool.data.fill_(2.0)
    assert payload != pool.page_bytes(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sizing_from_a_byte_budget(dtype):
    page_size = 4
    bytes_per_page = (
        2 * LAYERS * HEADS * HEAD_DIM * page_size * (4 if dtype == torch.float32 else 2)
    )
    budget = 10 * bytes_per_page + bytes_per_page // 2
    tokens = HostKVPool.tokens_for_bytes(budget, page_size, LAYERS, HEADS, HEAD_DIM, dtype)
    assert tokens == 10 * page_size
    pool = make_pool(tokens, page_size, dtype)
    assert pool.num_pages * pool.bytes_per_page <= budget
    assert (pool.num_pages + 1) * pool.bytes_per_page > budget
    assert (
        HostKVPool.tokens_for_bytes(bytes_per_page - 1, page_size, LAYERS, HEADS, HEAD_DIM, dtype)
        == 0
    )


def test_runs_of_consecutive_pages():
    runs = HostKVPool.page_runs
    assert runs(torch.tensor([], dtype=torch.int64)) == []
    pages = torch.tensor([3, 4, 5, 9, 1, 2, 7])
    assert runs(pages) == [(3, 0, 3), (9, 3, 1), (1, 4, 2), (7, 6, 1)]


def test_buffers_must_match_the_pool():
    pool = make_pool(num_tokens=8, page_size=4)
    good = [torch.zeros(9, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    pool.check_buffers(good, good)
    with pytest.raises(ValueError, match="layers"):
        pool.check_buffers(good[:2], good[:2])
    with pytest.raises(ValueError, match="does not match"):
        pool.check_buffers(good, [t.to(torch.bfloat16) for t in good])
    with pytest.raises(ValueError, match="does not match"):
        pool.check_buffers(good, [torch.zeros(9, HEADS + 1, HEAD_DIM) for _ in range(LAYERS)])
