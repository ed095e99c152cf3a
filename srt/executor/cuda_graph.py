"""CUDA graphs for decode: one graph per batch-size bucket, captured at start, replayed per step.

A captured step reads fixed input buffers (``input_ids``, ``positions``, ``out_kv_slots``,
``req_slots``, ``seq_lens``). A decode batch of B requests runs in the smallest bucket >= B:
its rows are copied into the buffers and the remaining rows are padding (token 0 at position
0, written to the padding KV slot 0, reading the all-zero padding request row, length 1), whose
logits are dropped. The attention backend plans each bucket's static batch with
``plan_for_capture`` before capture and ``plan_for_replay`` before each replay (the contract's
CUDA-graph hooks, ``kernels/attention/base.py``); a backend whose ``supports_cuda_graph`` is
False is refused here, and :func:`should_capture` keeps the model runner from asking.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixlm.kernels.attention.base import AttentionBackend

logger = logging.getLogger(__name__)


def batch_size_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32] + list(range(48, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_bs] + [max_bs]


def should_capture(device: torch.device, backend: AttentionBackend, disabled: bool) -> bool:
    """Whether decode runs through CUDA graphs: on a CUDA device, unless turned off, with an
    attention backend whose contract says it can be captured."""
    return device.type == "cuda" and not disabled and backend.supports_cuda_graph


class CudaGraphRunner:
    def __init__(self, runner, max_batch_size: int):
        if not runner.attn_backend.supports_cuda_graph:
            raise ValueError(f"the {runner.attn_backend.name} attention backend does not support "
                             "CUDA graphs; pass --disable-cuda-graph or another backend")
        self.runner = runner
        self.buckets = batch_size_buckets(max_batch_size)
        self.max_bs = self.buckets[-1]
        dev = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_kv_slots = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.req_slots = torch.full((self.max_bs,), runner.padding_req_slot, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # [bs, vocab] float32, the graphs' outputs
        self.pool = None
        runner.attn_backend.init_cuda_graph_state(self.max_bs, runner.max_total_tokens)
        self._capture_all()

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def _static_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_kv_slots=self.out_kv_slots[:bs], req_slots=self.req_slots[:bs],
            req_slots_cpu=[r.padding_req_slot] * bs, seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu, prefix_lens_cpu=[n - 1 for n in seq_lens_cpu],
            extend_lens_cpu=[1] * bs, req_to_token_pool=r.req_to_token_pool, kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
        )

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.runner.model(fb.input_ids, fb.positions, fb)
        return self.runner.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        for i, bs in enumerate(reversed(self.buckets)):  # largest first: later ones reuse its pool
            fb = self._static_batch(bs, [1] * bs)
            self.runner.attn_backend.plan_for_capture(fb)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (autotuning, lazy init) outside the graph
                    self._run_model(fb)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.logits[bs] = self._run_model(fb)
            self.pool = graph.pool()
            self.graphs[bs] = graph
            print(f"\rcapturing CUDA graphs: {i + 1}/{len(self.buckets)} (batch size {bs})",
                  end="", flush=True)
        print()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.buckets), self.buckets, time.perf_counter() - start)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs a decode ForwardBatch through the smallest fitting graph; ``[B, vocab]`` logits."""
        bs = fb.batch_size
        padded = self.buckets[bisect.bisect_left(self.buckets, bs)]
        self.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        self.positions[:bs].copy_(fb.positions, non_blocking=True)
        self.out_kv_slots[:bs].copy_(fb.out_kv_slots, non_blocking=True)
        self.req_slots[:bs].copy_(fb.req_slots, non_blocking=True)
        self.seq_lens[:bs].copy_(fb.seq_lens, non_blocking=True)
        if padded > bs:
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.out_kv_slots[bs:padded].zero_()
            self.req_slots[bs:padded].fill_(self.runner.padding_req_slot)
            self.seq_lens[bs:padded].fill_(1)
        static = self._static_batch(padded, fb.seq_lens_cpu + [1] * (padded - bs))
        static.req_slots_cpu = fb.req_slots_cpu + [self.runner.padding_req_slot] * (padded - bs)
        self.runner.attn_backend.plan_for_replay(static)
        self.graphs[padded].replay()
        return self.logits[padded][:bs]
