"""Start-up resolution: ``resolve`` makes every ``auto`` concrete once, per device, and logs
the result (``describe``)."""

from __future__ import annotations

import logging
from dataclasses import fields

from radixlm.srt.config.options import HICACHE_PAGE_SIZE, SECRET_FIELDS, ServerConfig

# chunked_prefill_size when not given. With mixed batches a running request waits at most one
# chunk step for its next token. GPU: an 8B model's chunk of N tokens costs ~N * 16 GFLOP
# (8,192: ~0.2 s at 650 TFLOP/s). Serving the 8B shape on an H200 (docs/results/serving.md),
# 2,048-token chunks cut prefill throughput below the offered load (goodput 2.8 req/s at 16
# req/s against 5.3 with 8,192 and 5.7 unchunked); 8,192 keeps most of it and still bounds the
# stall behind a long prompt.
# CPU (SmolLM2-135M fp32, 2 cores): 512 bounds the decode gap behind an 8K prompt at 1.8 s
# (15 s unchunked), prefilling within 7% of 1,024 or 2,048 (docs/results/serving.md).
GPU_DEFAULT_CHUNK = 8192
CPU_DEFAULT_CHUNK = 512
# Mixed steps (a chunk together with the running requests' decode tokens) by device and attention
# backend, unless --enable-mixed-chunk / --disable-mixed-chunk says. CPU: on (the decode gap
# behind an 8K prompt is 1.8 s mixed, 17.6 s with 2,048-token chunks alone). GPU with FlashInfer
# (the GPU default): on, since its mixed steps send their one-token rows to the decode kernel
# (attention 1.05x a prefill-only step's at 8,192 tokens): on an H100 serving the 8B shape
# (2026-12-07, gpu_runs.sh serveattn, docs/results/serving.md) mixed steps met the SLO for 90% of
# requests at 12 req/s against 85% with chunks alone, TPOT p99 108 ms against 211. GPU with
# Triton: off, as SGLang's default: its mixed steps prefilled at 25.8k tok/s against 38.1k alone
# and at 12 req/s met the SLO for 56% against 76% (gpu_runs.sh servemix).
# --mixed-chunk-size / --mixed-step-target-ms turn bounded mixed steps on.
MIXED_CHUNK_BY_DEVICE = {"cpu": True, "cuda": False}
MIXED_CHUNK_BY_BACKEND = {("cuda", "flashinfer"): True}

# under the package's name (radixlm.srt.config), the one logger of the config
logger = logging.getLogger(__package__)


def mixed_by_default(device_type: str, backend: str) -> bool:
    """Whether prefill chunks share steps with the running decodes when no flag says."""
    default = MIXED_CHUNK_BY_DEVICE.get(device_type, True)
    return MIXED_CHUNK_BY_BACKEND.get((device_type, backend), default)


def resolve(cfg: ServerConfig, *, head_dim: int | None = None) -> ServerConfig:
    """``cfg`` with every start-up ``auto`` made concrete, logged once: ``device`` (cuda when
    available), ``dtype`` (bfloat16 on a GPU, float32 on a CPU) and ``attention_backend``
    (``kernels.attention.registry``'s rule; ``head_dim`` is the model's, which FlashInfer may
    lack kernels for). Components read the result and never see ``auto`` again."""
    import torch  # here, not at the top: building the CLI parser needs no torch

    from radixlm.kernels.attention.registry import resolve_attention_backend

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch_device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}") from e
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch_device.type == "cuda" else "float32"
    backend = resolve_attention_backend(
        cfg.attention_backend, torch_device, head_dim, getattr(torch, dtype)
    )
    page_size = cfg.page_size
    if cfg.enable_hierarchical_cache and page_size == 1:
        page_size = HICACHE_PAGE_SIZE  # a disk file or a host copy per token costs too much
    chunk = cfg.chunked_prefill_size
    if chunk is None:
        chunk = GPU_DEFAULT_CHUNK if torch_device.type == "cuda" else CPU_DEFAULT_CHUNK
    capped = cfg.mixed_chunk_size is not None or cfg.mixed_step_target_ms is not None
    mixed = cfg.enable_mixed_chunk or (
        not cfg.disable_mixed_chunk and (capped or mixed_by_default(torch_device.type, backend))
    )
    resolved = cfg.replace(
        device=device,
        dtype=dtype,
        attention_backend=backend,
        page_size=page_size,
        chunked_prefill_size=chunk,
        disable_mixed_chunk=not mixed,  # the scheduler reads this one
    )
    if cfg.enable_torch_compile:
        logger.warning("enable_torch_compile: not used (CUDA graphs over the Triton kernels)")
    logger.info("config: %s", describe(resolved))
    return resolved


def describe(cfg: ServerConfig) -> str:
    """The fields that differ from their defaults, plus the resolved ones; secrets masked."""
    shown = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if value == f.default and f.name not in (
            "device",
            "dtype",
            "attention_backend",
            "chunked_prefill_size",
        ):
            continue
        shown.append(f"{f.name}={'***' if f.name in SECRET_FIELDS and value else value!r}")
    return ", ".join(shown)
