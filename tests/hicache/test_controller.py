"""HiCacheController: copies through the engine, counts them, measures bandwidth (seeded by a
calibration that leaves the live buffers alone), orders copies that share host pages."""

from __future__ import annotations

import pytest
import torch

from radixlm.hicache.controller import BandwidthMeter, HiCacheController
from radixlm.hicache.copy_engine import CopyOp, CudaCopyEngine, SyncCopyEngine
from radixlm.hicache.host_pool import HostKVPool

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4


def make_setup(dtype=torch.float32, device="cpu", pin=False, num_slots=64, **kwargs):
    gen = torch.Generator().manual_seed(0)
    shape = (num_slots + 1, HEADS, HEAD_DIM)
    k = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(LAYERS)]
    v = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(LAYERS)]
    pool = HostKVPool(64, PAGE, LAYERS, HEADS, HEAD_DIM, dtype, pin_memory=pin)
    return k, v, pool, HiCacheController(k, v, pool, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calibration_leaves_the_live_buffers_alone(dtype):
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(17, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    v = [torch.randn(17, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    k0, v0 = [t.clone() for t in k], [t.clone() for t in v]
    pool = HostKVPool(16, PAGE, LAYERS, HEADS, HEAD_DIM, dtype)
    controller = HiCacheController(k, v, pool)
    assert all(torch.equal(a, b) for a, b in zip(k + v, k0 + v0, strict=True))
    assert pool.used_size() == 0
    assert controller.load_bytes_per_s() > 0 and controller.write_bytes_per_s() > 0
    assert isinstance(controller.engine, SyncCopyEngine)
    assert controller.bytes_per_token == pool.bytes_per_token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_and_counters(dtype):
    k, v, pool, controller = make_setup(dtype)
    src, dst = torch.arange(5, 13), torch.tensor([40, 41, 42, 43, 20, 21, 22, 23])
    host = pool.alloc(8)
    write = controller.write_back(src, host)
    load = controller.load_back(host, dst)
    for layer in range(LAYERS):
        assert torch.equal(k[layer][dst], k[layer][src])
        assert torch.equal(v[layer][dst], v[layer][src])
    stats = controller.stats()
    assert stats["written_bytes"] == stats["loaded_bytes"] == 8 * pool.bytes_per_token
    assert write.num_bytes == load.num_bytes == 8 * pool.bytes_per_token
    assert stats["write_ops"] == stats["load_ops"] == 1 and stats["pending_ops"] == 0
    assert stats["load_bytes_per_s"] > 0 and stats["write_bytes_per_s"] > 0


def test_completed_ops_update_the_bandwidth():
    # a half-life of one byte: each op's own rate replaces the estimate
    k, v, pool, controller = make_setup(half_life_bytes=1)
    calibrated = controller.write_bytes_per_s(), controller.load_bytes_per_s()
    host = pool.alloc(16)
    write = controller.write_back(torch.arange(1, 17), host)
    load = controller.load_back(host, torch.arange(17, 33))
    controller.poll()
    assert controller.write_bytes_per_s() == pytest.approx(write.num_bytes / write.seconds)
    assert controller.load_bytes_per_s() == pytest.approx(load.num_bytes / load.seconds)
    assert (controller.write_bytes_per_s(), controller.load_bytes_per_s()) != calibrated


def test_bandwidth_meter_weights_by_bytes():
    meter = BandwidthMeter(100.0, half_life_bytes=1000)
    meter.update(1000, 1000 / 300.0)  # an op of one half-life at 300 B/s: halfway there
    assert meter.bytes_per_s == pytest.approx(200.0)
    meter.update(1, 1 / 1e6)  # a tiny op barely moves it
    assert 200.0 < meter.bytes_per_s < 200.0 + 1e6 * 0.001
    before = meter.bytes_per_s
    meter.update(1000, 0.0)  # untimed ops are ignored
    meter.update(0, 1.0)
    meter.update(1000, None)
    assert meter.bytes_per_s == before


def test_estimate_load_seconds_uses_the_measured_rate():
    _, _, pool, controller = make_setup()
    rate = controller.load_bytes_per_s()
    assert controller.estimate_load_seconds(100) == pytest.approx(100 * pool.bytes_per_token / rate)
    assert controller.estimate_load_seconds(200) == pytest.approx(
        2 * controller.estimate_load_seconds(100)
    )


def test_mismatched_buffers_are_refused():
    k = [torch.zeros(9, HEADS, HEAD_DIM) for _ in range(LAYERS + 1)]
    pool = HostKVPool(16, PAGE, LAYERS, HEADS, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="layers"):
        HiCacheController(k, k, pool)


class PendingOp(CopyOp):
    """An op that stays unfinished until released."""

    def __init__(self, num_bytes: int):
        super().__init__(num_bytes, seconds=None)
        self.finished = False
        self.waited = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.waited = self.finished = True
        self._seconds = 1e-3


class RecordingEngine(SyncCopyEngine):
    """Copies synchronously, hands out unfinished ops, records each copy's ``after``."""

    def __init__(self):
        self.afters: list[list[CopyOp]] = []
        self.ops: list[PendingOp] = []

    def _pending(self, op: CopyOp, after) -> PendingOp:
        self.afters.append(list(after))
        self.ops.append(PendingOp(op.num_bytes))
        return self.ops[-1]

    def write(self, k_buffers, v_buffers, device_slots, host_pool, host_slots, after=()):
        op = super().write(k_buffers, v_buffers, device_slots, host_pool, host_slots)
        return self._pending(op, after)

    def load(self, host_pool, host_slots, k_buffers, v_buffers, device_slots, after=()):
        op = super().load(host_pool, host_slots, k_buffers, v_buffers, device_slots)
        return self._pending(op, after)


def test_copies_sharing_host_pages_are_ordered():
    k, v, pool, controller = make_setup()
    engine = RecordingEngine()
    controller.engine = engine
    a, b = pool.alloc(8), pool.alloc(4)
    write_a = controller.write_back(torch.arange(1, 9), a)
    load_b = controller.load_back(b, torch.arange(9, 13))  # other pages: not ordered
    load_a = controller.load_back(a[4:], torch.arange(13, 17))  # reads what write_a fills
    write_b = controller.write_back(torch.arange(17, 21), b)  # overwrites what load_b reads
    assert engine.afters == [[], [], [write_a], [load_b]]
    assert load_a is not None

    controller.poll()  # nothing finished: nothing counted
    assert controller.stats()["write_ops"] == 0 and controller.stats()["pending_ops"] == 4
    write_a.finished = True
    controller.poll()
    stats = controller.stats()
    assert stats["write_ops"] == 1 and stats["written_bytes"] == write_a.num_bytes
    assert stats["load_ops"] == 0  # load_b, first in its queue, is not done
    controller.synchronize()
    assert all(op.waited for op in (write_b, load_b, load_a))
    stats = controller.stats()
    assert stats["write_ops"] == 2 and stats["load_ops"] == 2 and stats["pending_ops"] == 0


# ------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_controller_round_trip(dtype):
    k, v, pool, controller = make_setup(dtype, device="cuda", pin=True)
    assert isinstance(controller.engine, CudaCopyEngine)
    k0 = [t.clone() for t in k]
    host = pool.alloc(16)
    src = torch.arange(1, 17, device="cuda")
    dst = torch.arange(33, 49)
    controller.write_back(src, host)
    controller.load_back(host, dst).make_stream_wait()
    for layer in range(LAYERS):
        assert torch.equal(k[layer][33:49], k0[layer][1:17])
    controller.synchronize()
    stats = controller.stats()
    assert stats["load_ops"] == stats["write_ops"] == 1 and stats["pending_ops"] == 0
    assert stats["load_bytes_per_s"] > 1e6 and stats["write_bytes_per_s"] > 1e6


@pytest.mark.gpu
def test_cuda_load_of_pages_being_written_waits_for_the_write():
    k, v, pool, controller = make_setup(torch.float32, device="cuda", pin=True)
    host = pool.alloc(16)
    pool.data.zero_()
    src, dst = torch.arange(1, 17, device="cuda"), torch.arange(33, 49, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # both copies start behind this
    controller.write_back(src, host)
    controller.load_back(host, dst).make_stream_wait()  # must read what the write lands
    for layer in range(LAYERS):
        assert torch.equal(k[layer][dst], k[layer][src])
        assert torch.equal(v[layer][dst], v[layer][src])
