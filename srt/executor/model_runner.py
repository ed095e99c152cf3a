"""Owns the model, its KV memory and its attention backend; runs one forward per batch."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import psutil
import torch

from radixlm.kernels.attention.registry import make_attention_backend
from radixlm.srt.config import ServerConfig, resolve
from radixlm.srt.executor.cuda_graph import CudaGraphRunner, should_capture
from radixlm.srt.executor.forward_batch import ForwardBatch
from radixlm.srt.executor.memory_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from radixlm.srt.executor.transfer import to_device
from radixlm.srt.models.default_model import resolve_model_path
from radixlm.srt.models.loader import load_model, load_tokenizer
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.quantize import quantize_model

if TYPE_CHECKING:
    from radixlm.srt.scheduler.batch import ScheduledBatch  # annotation only: a higher layer

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BUDGET_GB = 2.0
MAX_GRAPH_BATCH = 512


class ModelRunner:
    def __init__(self, cfg: ServerConfig):
        self.model_dir = resolve_model_path(cfg.model_path, need_weights=cfg.load_format != "dummy")
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        # the one place auto values are resolved: the attention backend depends on the model's
        # head size, which is known from here on
        self.cfg = cfg = resolve(cfg, head_dim=self.model_config.head_dim)
        self.device = torch.device(cfg.device)
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        if self.device.type == "cpu" and cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.tokenizer = load_tokenizer(cfg.tokenizer_path or self.model_dir)
        self.model = load_model(
            self.model_dir, self.dtype, self.device, dummy=cfg.load_format == "dummy"
        )
        quantize_model(self.model, cfg.quantization, self.device)
        mc = self.model_config
        num_slots = self._size_kv_pool()
        self.context_length = min(cfg.context_length or mc.context_length, num_slots)
        self.kv_pool = KVPool(
            num_slots, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
        )
        self.allocator = TokenSlotAllocator(num_slots, cfg.page_size, self.device)
        self.req_to_token_pool = ReqToTokenPool(
            cfg.max_running_requests + 8, self.context_length + 1, self.device
        )
        self.attn_backend = make_attention_backend(
            cfg.attention_backend,
            self.device,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            page_size=cfg.page_size,
            dtype=self.dtype,
        )
        self.padding_req_slot = ReqToTokenPool.PADDING_ROW
        self.graph_runner = None
        if should_capture(self.device, self.attn_backend, cfg.disable_cuda_graph):
            self.graph_runner = CudaGraphRunner(
                self, min(cfg.max_running_requests, MAX_GRAPH_BATCH)
            )
        logger.info(
            "model %s (%s) on %s/%s; KV pool: %d tokens (%.2f GiB), context length %d, attention %s",
            self.model_dir,
            mc.architecture,
            self.device,
            self.dtype,
            self.max_total_tokens,
            self.max_total_tokens * self._kv_bytes_per_token() / 2**30,
            self.context_length,
            self.attn_backend.name,
        )

    def _kv_bytes_per_token(self) -> int:
        mc = self.model_config
        return KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)

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
        still on the device (the previous step's samples, not yet read back)."""
        fb = ForwardBatch.from_scheduled(
            batch,
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            input_ids_on_device=input_ids_on_device,
        )
        if (
            fb.mode.is_decode
            and self.graph_runner is not None
            and self.graph_runner.can_run(fb.batch_size)
        ):
            logits = self.graph_runner.replay(fb)
            if len(logit_rows) != logits.shape[0]:
                logits = logits[to_device(logit_rows, self.device)]
            return logits
        self.attn_backend.plan(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        if len(logit_rows) != hidden.shape[0]:
            hidden = hidden[to_device(logit_rows, self.device)]
        return self.model.compute_logits(hidden)
