"""The forward batch's named constructors: a scheduler's batch becomes the forward batch with
the fields the old layout path gave it, and the static CUDA-graph batch is all padding."""

from __future__ import annotations

import torch

from radixlm.kernels.attention.torch_backend import TorchAttentionBackend
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.memory_pool import KVPool, ReqToTokenPool
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.batch import ScheduledBatch
from radixlm.srt.scheduler.req import Req

CPU = torch.device("cpu")


def _pools() -> tuple[ReqToTokenPool, KVPool]:
    return ReqToTokenPool(8, 32, CPU), KVPool(64, 1, 2, 8, torch.float32, CPU)


def _mixed_batch() -> ScheduledBatch:
    """A prefill chunk (tokens 2..5 of a 6-token prompt, 2 cached), a whole prompt, and a
    decode step (prompt of 3 plus 2 generated tokens: the last one is new)."""
    chunk = Req(rid="chunk", prompt_ids=[11, 12, 13, 14, 15, 16], params=SamplingParams())
    whole = Req(rid="whole", prompt_ids=[21, 22], params=SamplingParams())
    decode = Req(
        rid="decode", prompt_ids=[31, 32, 33], params=SamplingParams(), output_ids=[34, 35]
    )
    for slot, req in zip((3, 1, 5), (chunk, whole, decode), strict=True):
        req.req_slot = slot
    batch = ScheduledBatch(ForwardMode.EXTEND)
    batch.add(chunk, 2, 3, torch.tensor([40, 41, 42]))
    batch.add(whole, 0, 2, torch.tensor([7, 8]))
    batch.add(decode, 4, 1, torch.tensor([50]))
    return batch


def test_from_scheduled_has_the_old_layout_fields():
    r2t, kv = _pools()
    backend = TorchAttentionBackend()
    fb = ForwardBatch.from_scheduled(
        _mixed_batch(), req_to_token_pool=r2t, kv_pool=kv, attn_backend=backend
    )
    assert fb.mode is ForwardMode.EXTEND
    assert fb.input_ids.tolist() == [13, 14, 15, 21, 22, 35]
    assert fb.positions.tolist() == [2, 3, 4, 0, 1, 4]
    assert fb.out_kv_slots.tolist() == [40, 41, 42, 7, 8, 50]
    assert fb.req_slots.tolist() == fb.req_slots_cpu == [3, 1, 5]
    assert fb.seq_lens.tolist() == fb.seq_lens_cpu == [5, 2, 5]
    assert (fb.prefix_lens_cpu, fb.extend_lens_cpu) == ([2, 0, 4], [3, 2, 1])
    assert all(
        t.dtype == torch.int64
        for t in (fb.input_ids, fb.positions, fb.req_slots, fb.seq_lens, fb.out_kv_slots)
    )
    assert (fb.req_to_token_pool, fb.kv_pool, fb.attn_backend) == (r2t, kv, backend)
    assert (fb.batch_size, fb.num_tokens) == (3, 6)


def test_from_scheduled_takes_input_ids_still_on_the_device():
    r2t, kv = _pools()
    on_device = torch.tensor([9, 9, 9, 9, 9, 9])
    fb = ForwardBatch.from_scheduled(
        _mixed_batch(),
        req_to_token_pool=r2t,
        kv_pool=kv,
        attn_backend=TorchAttentionBackend(),
        input_ids_on_device=on_device,
    )
    assert fb.input_ids is on_device
    assert fb.positions.tolist() == [2, 3, 4, 0, 1, 4]


def test_graph_capture_batch_is_padding_and_views_share_its_buffers():
    r2t, kv = _pools()
    pad = ReqToTokenPool.PADDING_ROW
    static = ForwardBatch.for_graph_capture(
        8, pad, req_to_token_pool=r2t, kv_pool=kv, attn_backend=TorchAttentionBackend()
    )
    assert static.mode is ForwardMode.DECODE and static.batch_size == 8
    assert static.input_ids.tolist() == static.positions.tolist() == [0] * 8
    assert static.out_kv_slots.tolist() == [0] * 8
    assert static.req_slots.tolist() == static.req_slots_cpu == [pad] * 8
    assert static.seq_lens.tolist() == static.seq_lens_cpu == [1] * 8
    view = static.graph_view(4, [6, 1, 1, 1], [3, pad, pad, pad])
    assert view.batch_size == 4 and view.num_tokens == 4
    assert (view.prefix_lens_cpu, view.extend_lens_cpu) == ([5, 0, 0, 0], [1] * 4)
    assert view.req_slots_cpu == [3, pad, pad, pad]
    view.seq_lens[0] = 6  # a replay refills the static buffers in place: views see it
    assert static.seq_lens[0].item() == 6
    assert static.graph_view(2).seq_lens_cpu == [1, 1]
