"""The draft model's runner: a ModelRunner of its own, checked against the target at start-up.

The draft runs through the executor's public ``ModelRunner`` (built from a copy of the server
config), with its own KV pool, request table and CUDA graphs; batches reach it as a small
duck-typed batch (:class:`DraftBatch`, what ``ForwardBatch.from_scheduled`` reads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from radixlm.srt.config import ServerConfig
from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.executor.memory_pool import KVPool
from radixlm.srt.executor.model_runner import ModelRunner
from radixlm.srt.models.default_model import resolve_model_path
from radixlm.srt.models.loader import safetensors_files
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# share of the device memory free after the target was built that the draft may take (weights
# and KV pool); the rest stays for activations and the target's own growth
DRAFT_MEMORY_SHARE = 0.5
CPU_DRAFT_MEMORY_SHARE = 0.25  # of the available RAM (as the target's default CPU pool)
MIN_DRAFT_POOL_TOKENS = 256


def check_same_tokenizer(draft_dir: Path, target_tokenizer: Any) -> None:
    """ValueError naming ``speculative_draft_model_path`` when the draft's tokenizer maps
    text to different ids than the target's."""
    draft_tok = load_tokenizer(draft_dir)
    if draft_tok.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"speculative_draft_model_path {str(draft_dir)!r}: its tokenizer differs from the "
            f"target model's ({len(draft_tok)} vs {len(target_tokenizer)} tokens); a draft "
            "model must share the target's tokenizer"
        )


def draft_pool_tokens(cfg: ServerConfig, target: Any, draft_dir: Path, mc: ModelConfig) -> int:
    """KV slots of the draft pool: room for every token the target pool can hold plus a draft
    per running request, capped by the memory left after the target (GPU: a share of the free
    device memory less the draft's weights; CPU: a quarter of the available RAM)."""
    wanted = target.max_total_tokens + cfg.max_running_requests * (
        cfg.speculative_num_draft_tokens + 1
    )
    per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, target.dtype)
    device = torch.device(target.cfg.device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        weights = sum(f.stat().st_size for f in safetensors_files(draft_dir))
        budget = free * DRAFT_MEMORY_SHARE - weights
    else:
        budget = CPU_DRAFT_MEMORY_SHARE * psutil.virtual_memory().available
    fits = int(budget // per_token)
    if fits < MIN_DRAFT_POOL_TOKENS:
        raise ValueError(
            f"speculative_draft_model_path {str(draft_dir)!r}: no memory left for the draft "
            f"model's KV pool after the target's ({budget / 2**30:.2f} GiB); lower "
            "--mem-fraction-static or --max-total-tokens"
        )
    if fits < wanted:
        logger.warning(
            "draft KV pool: %d tokens fit (the target pool holds %d); requests beyond that "
            "decode without drafts",
            fits,
            target.max_total_tokens,
        )
    return min(wanted, fits)


def build_draft_runner(cfg: ServerConfig, target: Any) -> ModelRunner:
    """A ModelRunner for ``cfg.speculative_draft_model_path`` beside the ``target`` runner:
    same device, dtype and attention settings, single-token pages, no prefix tiers."""
    path = cfg.speculative_draft_model_path
    if not path:
        raise ValueError("speculative_algorithm draft needs speculative_draft_model_path")
    if cfg.tp_size > 1:
        raise ValueError(
            "speculative_algorithm draft (speculative_draft_model_path) does not support "
            f"tp_size > 1 yet, got tp_size {cfg.tp_size}"
        )
    tc = target.cfg  # resolved: the draft runs where the target runs, in its dtype
    need_weights = tc.load_format != "dummy"
    try:
        draft_dir = resolve_model_path(path, need_weights=need_weights)
        mc = ModelConfig.from_pretrained(draft_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_draft_model_path {path!r}: {e}") from e
    check_same_tokenizer(draft_dir, target.tokenizer)
    draft_cfg = cfg.replace(  # the user's settings (auto: resolved for the draft's shape)
        device=tc.device,
        dtype=tc.dtype,
        load_format=tc.load_format,
        model_path=str(draft_dir),
        tokenizer_path=None,
        served_model_name=None,
        context_length=None,
        max_total_tokens=draft_pool_tokens(cfg, target, draft_dir, mc),
        mem_budget_gb=None,
        page_size=1,  # rejected draft tokens are freed one by one
        enable_hierarchical_cache=False,
        speculative_algorithm="none",
        speculative_draft_model_path=None,
        tp_size=1,
    )
    return ModelRunner(draft_cfg)


@dataclass
class DraftRow:
    """What ``ForwardBatch.from_scheduled`` reads of a request."""

    req_slot: int


@dataclass
class DraftBatch:
    """A batch for the draft runner, shaped as the scheduler's (``ScheduledBatch``)."""

    mode: ForwardMode
    reqs: list[DraftRow] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # host ids (extend batches)

    def add(self, req_slot: int, start: int, slots: torch.Tensor, tokens: list[int]) -> None:
        self.reqs.append(DraftRow(req_slot))
        self.starts.append(start)
        self.extend_lens.append(len(slots))
        self.slots.append(slots)
        self.tokens.append(tokens)

    def input_ids(self) -> list[int]:
        return [t for tokens in self.tokens for t in tokens]

    def positions(self) -> list[int]:
        out: list[int] = []
        for start, ext in zip(self.starts, self.extend_lens, strict=True):
            out += range(start, start + ext)
        return out

    def last_rows(self) -> list[int]:
        """Each request's last new token's row (where its next-token logits are)."""
        rows, end = [], 0
        for ext in self.extend_lens:
            end += ext
            rows.append(end - 1)
        return rows


def to_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits ``[n, V_draft]`` as ``[n, vocab_size]`` of the target: ids the target does
    not have are cut, ids the draft does not have get -inf."""
    have = logits.shape[1]
    if have == vocab_size:
        return logits
    if have > vocab_size:
        return logits[:, :vocab_size]
    pad = logits.new_full((logits.shape[0], vocab_size - have), float("-inf"))
    return torch.cat([logits, pad], dim=1)
