"""Owns the model, its KV memory and its attention backend; runs one forward per batch."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

import psutil
import torch

from radixlm.kernels import gguf_cpu, int4_cpu
from radixlm.kernels.attention.base import (
    attention_variants,
    check_backend_serves,
    model_has_sinks,
)
from radixlm.kernels.attention.registry import make_attention_backend
from radixlm.srt.config import ServerConfig, resolve
from radixlm.srt.distributed import (
    TPGroup,
    check_tp_config,
    cpu_threads_per_rank,
    init_distributed,
    tp_device,
)
from radixlm.srt.executor.cuda_graph import CudaGraphRunner, should_capture
from radixlm.srt.executor.forward_batch import ForwardBatch
from radixlm.srt.executor.kv_calibration import apply_kv_scales
from radixlm.srt.executor.memory_pool import (
    KVPool,
    ReqToTokenPool,
    TokenSlotAllocator,
    kv_storage_dtype,
)
from radixlm.srt.executor.quant_check import quantise_and_check
from radixlm.srt.executor.tp_sync import StepReceiver, StepSender
from radixlm.srt.executor.transfer import to_device
from radixlm.srt.models.default_model import resolve_model_path
from radixlm.srt.models.loader import load_model
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.tokenizer import load_tokenizer
from radixlm.srt.models.tp_layers import HeadShard

if TYPE_CHECKING:
    from radixlm.srt.scheduler.batch import ScheduledBatch  # annotation only: a higher layer

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BUDGET_GB = 2.0
MAX_GRAPH_BATCH = 512


def graph_max_batch(cfg: ServerConfig) -> int:
    """The largest decode batch captured in a CUDA graph (``--cuda-graph-max-bs``, SGLang's)."""
    limit = MAX_GRAPH_BATCH if cfg.cuda_graph_max_bs is None else cfg.cuda_graph_max_bs
    return min(cfg.max_running_requests, limit)


class ModelRunner:
    """Tensor parallelism (``cfg.tp_size > 1``): one runner per rank, each holding its slices of
    the weights and its KV heads. ``tp_group`` is this rank's group (joined here from
    ``tp_rank`` when not given). On rank 0 ``forward`` broadcasts each step before computing it
    and returns full-vocabulary logits; a follower calls :meth:`follow`, which runs rank 0's
    steps until rank 0 calls :meth:`stop_followers`."""

    def __init__(self, cfg: ServerConfig, tp_rank: int = 0, tp_group: TPGroup | None = None):
        check_tp_config(cfg)
        self.tp = tp_group if tp_group is not None else init_distributed(cfg, tp_rank)
        self.model_dir = resolve_model_path(cfg.model_path, need_weights=cfg.load_format != "dummy")
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        # the one place auto values are resolved: the attention backend depends on the model's
        # head size, which is known from here on
        self.cfg = cfg = resolve(cfg, head_dim=self.model_config.head_dim)
        self.device = self._place_rank(cfg)
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        self.tokenizer = load_tokenizer(cfg.tokenizer_path or self.model_dir, cfg.chat_template)
        self.model = load_model(
            self.model_dir, self.dtype, self.device, dummy=cfg.load_format == "dummy", tp=self.tp
        )
        mc = self.model_config
        # this rank's attention heads (all of them without tensor parallelism)
        self.heads = HeadShard.for_rank(mc.num_heads, mc.num_kv_heads, self.tp.size, self.tp.rank)
        # --quantization, and the accuracy check of a quantised model (/server_info)
        self.quant_report = quantise_and_check(
            self.model, cfg, self.tokenizer, mc, self.heads.num_kv_heads, self.device
        )
        # the KV pool's storage dtype (fp8 with --kv-cache-dtype fp8_*); validated here
        self.kv_dtype = kv_storage_dtype(
            cfg.kv_cache_dtype, self.dtype, cfg.quantization, self.device
        )
        num_slots = self.tp.min_int(self._size_kv_pool())  # every rank: the same slot layout
        self.context_length = min(cfg.context_length or mc.context_length, num_slots)
        self.kv_pool = KVPool(
            num_slots,
            mc.num_layers,
            self.heads.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
            storage_dtype=self.kv_dtype,
        )
        self.allocator = TokenSlotAllocator(num_slots, cfg.page_size, self.device)
        self.req_to_token_pool = ReqToTokenPool(
            cfg.max_running_requests + 8, self.context_length + 1, self.device
        )
        self.attn_backend = make_attention_backend(
            cfg.attention_backend,
            self.device,
            num_heads=self.heads.num_heads,
            num_kv_heads=self.heads.num_kv_heads,
            head_dim=mc.head_dim,
            page_size=cfg.page_size,
            dtype=self.dtype,
            variants=attention_variants(self.model),
            sinks=model_has_sinks(self.model),
        )
        check_backend_serves(self.attn_backend, self.model)
        self.padding_req_slot = ReqToTokenPool.PADDING_ROW
        if self.kv_pool.is_quantized:  # before graph capture: graphs hold the scales as constants
            apply_kv_scales(self)
        # with speculation, verify batches (1 + k tokens per request) replay the decode graphs
        # as one row per token; longer extends (prefills) never do
        self.max_verify_rows = (
            1 + cfg.speculative_num_draft_tokens if cfg.speculative_algorithm != "none" else 1
        )
        # each row re-reads its request's cached tokens: rows run in the graphs while those
        # extra reads stay under twice the weights' bytes (beyond that the extend kernels win;
        # measured on the H200 with srt/bench/verify_cost.py)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.max_extra_verify_reads = 2 * weight_bytes // self._kv_bytes_per_token()
        self.graph_runner = None
        if should_capture(self.device, self.attn_backend, cfg.disable_cuda_graph):
            self.graph_runner = CudaGraphRunner(self, graph_max_batch(cfg))
        self.step_sender: StepSender | None = None  # rank 0 of several: broadcasts each step
        self.step_receiver: StepReceiver | None = None  # a follower: receives them
        if self.tp.is_distributed and self.tp.is_leader:
            self.step_sender = StepSender(self.tp, self.req_to_token_pool)
        elif self.tp.is_distributed:
            self.step_receiver = StepReceiver(self.tp, self.req_to_token_pool)
        logger.info(
            "model %s (%s) on %s/%s; KV pool: %d tokens of %s (%.2f GiB), context length %d, "
            "attention %s",
            self.model_dir,
            mc.architecture,
            self.device,
            self.dtype,
            self.max_total_tokens,
            self.kv_dtype,
            self.max_total_tokens * self._kv_bytes_per_token() / 2**30,
            self.context_length,
            self.attn_backend.name,
        )

    def _place_rank(self, cfg: ServerConfig) -> torch.device:
        """This rank's device (``cuda:<local rank>`` with tensor parallelism) and, on a CPU, its
        intra-op threads (``--num-threads``, else the cores shared among the machine's ranks)."""
        if not self.tp.is_distributed:
            device = torch.device(cfg.device)
        else:
            if self.tp.size != cfg.tp_size:
                raise ValueError(f"tp_group has {self.tp.size} ranks, tp_size is {cfg.tp_size}")
            device = tp_device(cfg, self.tp.local_rank)
        if device.type == "cpu" and cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        elif device.type == "cpu" and self.tp.is_distributed:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
            ranks_here = self.tp.size // cfg.nnodes
            torch.set_num_threads(cpu_threads_per_rank(cores or os.cpu_count() or 1, ranks_here))
        return device

    def _kv_bytes_per_token(self) -> int:
        mc = self.model_config
        return KVPool.bytes_per_token(
            mc.num_layers, self.heads.num_kv_heads, mc.head_dim, self.kv_dtype
        )

    @property
    def max_total_tokens(self) -> int:
        """The KV pool's size in tokens; the allocator is its one source."""
        return self.allocator.max_total_tokens

    def _size_kv_pool(self) -> int:
        if self.cfg.max_total_tokens is not None:
            return self.cfg.max_total_tokens
        if self.cfg.mem_budget_gb is not None:
            budget = self.cfg.mem_budget_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = max(total * self.cfg.mem_fraction_static - used, 0)
        else:
            budget = min(CPU_DEFAULT_KV_BUDGET_GB * 2**30, 0.25 * psutil.virtual_memory().available)
        tokens = int(budget // self._kv_bytes_per_token())
        if tokens < 16:
            raise ValueError(
                f"not enough memory for the KV pool ({budget / 2**30:.2f} GiB); "
                "lower --mem-fraction-static use or pass --max-total-tokens"
            )
        return tokens

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.inference_mode()
    def forward(
        self,
        batch: ScheduledBatch,
        logit_rows: list[int],
        input_ids_on_device: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the model on a scheduler's batch and returns float32 logits
        ``[len(logit_rows), vocab]`` for the given token rows of the batch (e.g. the last new
        token of each request). ``input_ids_on_device``: the batch's input ids when they are
        still on the device (the previous step's samples, not yet read back). With tensor
        parallelism (rank 0 only) the step is first broadcast to the followers."""
        fb = ForwardBatch.from_scheduled(
            batch,
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            input_ids_on_device=input_ids_on_device,
        )
        if self.step_sender is not None:
            self.step_sender.send(fb, logit_rows)
        return self._run(fb, logit_rows)

    def _run(self, fb: ForwardBatch, logit_rows: list[int]) -> torch.Tensor:
        graphs = self.graph_runner
        if graphs is not None and not fb.mode.is_decode and self._verify_fits_graphs(fb):
            fb = fb.as_decode_rows()  # the same tokens, logits rows and KV writes
        if fb.mode.is_decode and graphs is not None and graphs.can_run_rows(fb):
            self.kv_pool.layer_loads.wait_all()  # captured kernels cannot wait per layer
            logits = graphs.replay(fb)
            if len(logit_rows) != logits.shape[0]:
                logits = logits[to_device(logit_rows, self.device)]
            return logits
        self.attn_backend.plan(fb)
        with self._int4_rows(fb):
            hidden = self.model(fb.input_ids, fb.positions, fb)  # waits per layer for loads
        self.kv_pool.layer_loads.end_forward()
        if len(logit_rows) != hidden.shape[0]:
            hidden = hidden[to_device(logit_rows, self.device)]
        return self.model.compute_logits(hidden)

    def _int4_rows(self, fb: ForwardBatch) -> contextlib.AbstractContextManager[None]:
        """An int4 CPU model multiplies decode batches of up to ``gguf_cpu.MATMUL_ROWS`` rows
        through its int4 kernels (int8 activations, as at batch 1); a forward with prompt tokens
        only up to ``int4_cpu.PROMPT_ROWS`` (above, the prompt's activations stay float32 in the
        dense weights)."""
        if self.cfg.quantization != "int4" or fb.mode.is_decode:
            return contextlib.nullcontext()
        return gguf_cpu.rows_limit(int4_cpu.PROMPT_ROWS)

    def _verify_fits_graphs(self, fb: ForwardBatch) -> bool:
        """Whether an extend batch is a speculative verify (every request continues a cached
        sequence with at most 1 + num_draft_tokens new tokens) whose decode rows fit the graphs
        and re-read at most ``max_extra_verify_reads`` cached tokens more than the extend would;
        from the host lists alone (row j of a request of p cached tokens reads p + j)."""
        cap = self.max_verify_rows
        if cap <= 1 or max(fb.extend_lens_cpu, default=0) > cap:
            return False
        if min(fb.prefix_lens_cpu, default=0) <= 0:
            return False
        lens = list(zip(fb.prefix_lens_cpu, fb.extend_lens_cpu, strict=True))
        row_reads = sum(e * p + e * (e + 1) // 2 for p, e in lens)
        graphs = self.graph_runner
        return (
            row_reads - sum(fb.seq_lens_cpu) <= self.max_extra_verify_reads
            and sum(fb.extend_lens_cpu) <= graphs.max_bs
            and row_reads <= graphs.max_kv_reads
        )

    @torch.inference_mode()
    def follow(self) -> None:
        """A follower rank's loop: runs every step rank 0 broadcasts (its logits are dropped)
        until rank 0 calls :meth:`stop_followers`, then returns. Raises ``RuntimeError`` when the
        group fails (a rank died, a collective timed out): the process should exit non-zero."""
        if self.step_receiver is None:
            raise RuntimeError("follow() runs on tensor-parallel ranks > 0 only")
        while (step := self.step_receiver.receive()) is not None:
            self._run(
                step.forward_batch(self.req_to_token_pool, self.kv_pool, self.attn_backend),
                step.logit_rows,
            )

    def stop_followers(self) -> None:
        """Rank 0: ends the followers' :meth:`follow` loops (once; a no-op without followers)."""
        if self.step_sender is not None:
            self.step_sender.stop()
