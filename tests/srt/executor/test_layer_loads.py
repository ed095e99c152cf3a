"""Layer-wise load-back: a host-tier load is handed to the forward, which waits for layer ``l``
of it just before layer ``l``'s attention (``KVPool.wait_loaded``), in layer order, and never for
the whole copy first; the logits of new tokens over a loaded prefix are bit-identical to those
over the prefix computed on the device (no cache).

CPU: the copy is deferred until the first wait (the latest an asynchronous engine may run it).
GPU (``gpu``): the CUDA copy engine with a pinned host pool, queued behind a sleep on its stream,
and the compute of layer 0 finishing before the copy of the last layer."""

from __future__ import annotations

import pytest
import torch

from radixlm.hicache.controller import HiCacheController
from radixlm.hicache.copy_engine import CopyOp, CudaCopyEngine, SyncCopyEngine
from radixlm.hicache.host_pool import HostKVPool
from radixlm.srt.config import config_from_kwargs
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.model_runner import ModelRunner

PAGE = 16


class RecordingOp(CopyOp):
    """Wraps a load: logs each wait the forward issues; ``deferred``: the copy runs at the
    first wait (as late as an asynchronous engine may run it)."""

    def __init__(self, inner: CopyOp | None, run=None) -> None:
        super().__init__(0 if inner is None else inner.num_bytes, seconds=None)
        self.inner = inner
        self._run = run
        self.log: list[object] = []

    def done(self) -> bool:
        return self._run is None and (self.inner is None or self.inner.done())

    def _ensure_run(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run()

    def wait(self) -> None:
        self._ensure_run()
        if self.inner is not None:
            self.inner.wait()

    def wait_layer(self, stream, layer: int) -> None:
        self.log.append(layer)
        self._ensure_run()
        if self.inner is not None:
            self.inner.wait_layer(stream, layer)

    def make_stream_wait(self, stream=None) -> None:
        self.log.append("whole")
        self._ensure_run()
        if self.inner is not None:
            self.inner.make_stream_wait(stream)


def _runner(model_dir, max_total_tokens: int) -> ModelRunner:
    return ModelRunner(
        config_from_kwargs(
            model_path=str(model_dir), max_total_tokens=max_total_tokens, log_level="warning"
        )
    )


def _extend(runner: ModelRunner, req_slot: int, ids: list[int], start: int, kv: torch.Tensor):
    """The logits of ``ids`` at positions ``start..`` over the KV already at ``kv[:start]``
    (the model runner's own forward path, which waits per layer for pending loads)."""
    runner.req_to_token_pool.write(req_slot, 0, kv)
    n = len(ids)
    fb = ForwardBatch.from_host(
        ForwardMode.EXTEND,
        ids,
        list(range(start, start + n)),
        kv[start : start + n],
        [req_slot],
        [start],
        [n],
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
    )
    with torch.inference_mode():
        return runner._run(fb, list(range(n)))


def _prefix_and_reference(runner: ModelRunner, num_prefix: int, num_new: int):
    """A prefix's KV computed on the device, then the new tokens' logits over it (the
    no-cache answer); returns (ids, the prefix's slots, the reference logits)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, runner.vocab_size, (num_prefix + num_new,), generator=gen).tolist()
    slot = runner.req_to_token_pool.alloc()
    kv = runner.allocator.alloc(num_prefix + num_new)
    assert slot is not None and kv is not None
    kv = kv.to(runner.device)
    _extend(runner, slot, ids[:num_prefix], 0, kv)
    reference = _extend(runner, slot, ids[num_prefix:], num_prefix, kv)
    return ids, kv[:num_prefix], reference.clone()


def _host_copy(runner: ModelRunner, engine, prefix_slots: torch.Tensor, pin: bool):
    pool = runner.kv_pool
    mc = runner.model_config
    host_pool = HostKVPool(
        prefix_slots.numel(),
        PAGE,
        mc.num_layers,
        mc.num_kv_heads,
        mc.head_dim,
        pool.transfer_dtype,
        pin_memory=pin,
    )
    controller = HiCacheController(
        *pool.transfer_buffers(),
        host_pool,
        engine,
        calibration_bytes=host_pool.bytes_per_page,
        layer_loads=pool.layer_loads,
    )
    host = host_pool.alloc(prefix_slots.numel())
    controller.write_back(prefix_slots, host).wait()
    return controller, host


def test_forward_waits_per_layer_for_a_deferred_load_and_matches_no_cache(
    offline_tiny_llama_dir,
):
    runner = _runner(offline_tiny_llama_dir, 512)
    num_prefix, num_new = 3 * PAGE, 7
    ids, prefix_slots, reference = _prefix_and_reference(runner, num_prefix, num_new)
    controller, host = _host_copy(runner, SyncCopyEngine(), prefix_slots, pin=False)

    slot = runner.req_to_token_pool.alloc()
    kv = runner.allocator.alloc(num_prefix + num_new)
    for k, v in zip(*runner.kv_pool.transfer_buffers(), strict=True):
        k[kv] = -3.0  # what the fresh slots held before: wrong KV
        v[kv] = -3.0
    op = RecordingOp(None, run=lambda: controller.load_back(host, kv[:num_prefix]).wait())
    loads = runner.kv_pool.layer_loads
    loads.add(op)
    assert loads.pending() == 1

    logits = _extend(runner, slot, ids[num_prefix:], num_prefix, kv)
    layers = runner.model_config.num_layers
    assert op.log == [*range(layers), "whole"]  # per layer, in order, then the end of forward
    assert loads.pending() == 0 and loads.whole_waits == 0
    assert torch.equal(logits, reference)  # token-identical to computing the prefix


def test_graph_replays_and_freed_slots_wait_for_the_whole_copy():
    loads_op = RecordingOp(None, run=lambda: None)
    from radixlm.hicache.copy_engine import LayerLoads

    loads = LayerLoads()
    loads.add(loads_op)
    loads.wait_all()
    assert loads_op.log == ["whole"] and loads.whole_waits == 1 and loads.pending() == 0
    loads.add(CopyOp(8))  # a finished copy is not kept
    assert loads.pending() == 0


@pytest.mark.gpu
def test_cuda_load_overlaps_the_forward_layer_by_layer(tiny_model_writer, word_tokenizer, tmp_path):
    model_dir = tiny_model_writer(
        tmp_path / "tiny8", word_tokenizer, num_hidden_layers=8, max_position_embeddings=65536
    )
    num_prefix, num_new = 2048 * PAGE, 16
    runner = _runner(model_dir, num_prefix * 2 + 2 * num_new)
    assert runner.device.type == "cuda"
    ids, prefix_slots, reference = _prefix_and_reference(runner, num_prefix, num_new)
    engine = CudaCopyEngine(runner.device)
    controller, host = _host_copy(runner, engine, prefix_slots, pin=True)

    slot = runner.req_to_token_pool.alloc()
    kv = runner.allocator.alloc(num_prefix + num_new).to(runner.device)
    torch.cuda.synchronize()
    with torch.cuda.stream(engine.load_stream):
        torch.cuda._sleep(50_000_000)  # the copy queues behind this: still pending below
    inner = controller.load_back(host, kv[:num_prefix])
    op = RecordingOp(inner)
    loads = runner.kv_pool.layer_loads
    loads.add(op)
    assert not inner.done() and loads.pending() == 1

    layer0_done = torch.cuda.Event(enable_timing=True)
    attn0 = runner.model.model.layers[0].self_attn
    hook = attn0.register_forward_hook(lambda *_: layer0_done.record())
    try:
        logits = _extend(runner, slot, ids[num_prefix:], num_prefix, kv)
    finally:
        hook.remove()
    torch.cuda.synchronize()
    layers = runner.model_config.num_layers
    assert op.log == [*range(layers), "whole"] and loads.whole_waits == 0
    assert torch.equal(logits, reference)
    # layer 0 computed while later layers were still crossing the bus
    assert layer0_done.elapsed_time(inner._end) > 0
