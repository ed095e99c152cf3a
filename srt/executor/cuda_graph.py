"""CUDA graphs for decode: one graph per batch-size bucket, captured at start, replayed per step.

Speculative verify batches (1 + k new tokens per request) run through the same graphs as one
decode row per new token (``ForwardBatch.as_decode_rows``, chosen in ``ModelRunner._run``).

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

from radixlm.srt.executor.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixlm.kernels.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

KV_READS_PER_POOL_TOKEN = 4  # graph state for rows reading 4x the pool's tokens (int32 each)


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
            raise ValueError(
                f"the {runner.attn_backend.name} attention backend does not support "
                "CUDA graphs; pass --disable-cuda-graph or another backend"
            )
        self.runner = runner
        self.buckets = batch_size_buckets(max_batch_size)
        self.max_bs = self.buckets[-1]
        self.padding_req_slot = runner.padding_req_slot
        # the graphs' fixed input buffers, every row padding until a replay fills it
        self.static = ForwardBatch.for_graph_capture(
            self.max_bs,
            self.padding_req_slot,
            req_to_token_pool=runner.req_to_token_pool,
            kv_pool=runner.kv_pool,
            attn_backend=runner.attn_backend,
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # [bs, vocab] float32, the graphs' outputs
        self.pool = None
        # cached tokens one captured step may read, summed over its rows: more than the pool
        # holds, since rows share prefix slots (a shared system prompt, a verify's rows)
        self.max_kv_reads = KV_READS_PER_POOL_TOKEN * runner.max_total_tokens
        runner.attn_backend.init_cuda_graph_state(self.max_bs, self.max_kv_reads)
        self._capture_all()

    def can_run_rows(self, fb: ForwardBatch) -> bool:
        """Whether the decode rows of ``fb`` (possibly several per request: a verify recast by
        ``ForwardBatch.as_decode_rows``) fit the graphs: the batch-size buckets, and the cached
        tokens the rows read together within what the backends' graph state was sized for."""
        return fb.batch_size <= self.max_bs and sum(fb.seq_lens_cpu) <= self.max_kv_reads

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.runner.model(fb.input_ids, fb.positions, fb)
        return self.runner.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        for i, bs in enumerate(reversed(self.buckets)):  # largest first: later ones reuse its pool
            fb = self.static.graph_view(bs)
            self.runner.attn_backend.plan_for_capture(fb)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (autotuning, lazy init) outside the graph
                    self._run_model(fb)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # with tensor parallelism the NCCL watchdog thread polls earlier collectives' events
            # during the capture: "global" capture mode would fail the capture on such a call
            mode = "thread_local" if self.runner.tp.is_distributed else "global"
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode=mode):
                self.logits[bs] = self._run_model(fb)
            self.pool = graph.pool()
            self.graphs[bs] = graph
            print(
                f"\rcapturing CUDA graphs: {i + 1}/{len(self.buckets)} (batch size {bs})",
                end="",
                flush=True,
            )
        print()
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.buckets),
            self.buckets,
            time.perf_counter() - start,
        )

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs a decode ForwardBatch through the smallest fitting graph; ``[B, vocab]`` logits."""
        bs = fb.batch_size
        padded = self.buckets[bisect.bisect_left(self.buckets, bs)]
        st = self.static
        st.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        st.positions[:bs].copy_(fb.positions, non_blocking=True)
        st.out_kv_slots[:bs].copy_(fb.out_kv_slots, non_blocking=True)
        st.req_slots[:bs].copy_(fb.req_slots, non_blocking=True)
        st.seq_lens[:bs].copy_(fb.seq_lens, non_blocking=True)
        if padded > bs:
            st.input_ids[bs:padded].zero_()
            st.positions[bs:padded].zero_()
            st.out_kv_slots[bs:padded].zero_()
            st.req_slots[bs:padded].fill_(self.padding_req_slot)
            st.seq_lens[bs:padded].fill_(1)
        pad = padded - bs
        view = st.graph_view(
            padded, fb.seq_lens_cpu + [1] * pad, fb.req_slots_cpu + [self.padding_req_slot] * pad
        )
        self.runner.attn_backend.plan_for_replay(view)
        self.graphs[padded].replay()
        return self.logits[padded][:bs]
