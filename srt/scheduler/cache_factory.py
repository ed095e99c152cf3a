"""Builds the prefix cache the configuration asks for and the KVManager that owns it.

``--disable-radix-cache``: NullCache. Default: RadixCache. ``--enable-hierarchical-cache``:
HiRadixCache over a host KV pool sized from ``--hicache-size`` (GiB) or ``--hicache-ratio`` (x
the device pool), and, with ``--hicache-storage-dir``, a disk page store in a folder named by
the model's fingerprint (so pages of another model, dtype or page size never match).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from radixlm.hicache.controller import HiCacheController
from radixlm.hicache.copy_engine import CudaCopyEngine, SyncCopyEngine
from radixlm.hicache.disk_store import DiskPageStore
from radixlm.hicache.host_pool import HostKVPool
from radixlm.hicache.storage_io import StorageIO
from radixlm.radix import PrefixCache, make_prefix_cache
from radixlm.radix.hiradix_cache import HiRadixCache
from radixlm.srt.config import ServerConfig
from radixlm.srt.scheduler.kv_manager import KVManager

logger = logging.getLogger(__name__)

DISK_READ_THREADS = 4  # page files read in parallel (file reads release the GIL)


def make_kv_manager(cfg: ServerConfig, runner: Any) -> KVManager:
    """The KV owner over the runner's pools, with the prefix cache ``cfg`` asks for
    (``cfg`` resolved: its page size is the allocator's)."""
    if not cfg.enable_hierarchical_cache:
        cache = make_prefix_cache(
            cfg.disable_radix_cache, cfg.page_size, runner.allocator.free, runner.device
        )
        return KVManager(runner.allocator, runner.req_to_token_pool, cache)
    holder: list[KVManager] = []
    cache = _make_hicache(cfg, runner, lambda n: holder[0].alloc_for_cache(n))
    kv = KVManager(runner.allocator, runner.req_to_token_pool, cache)
    holder.append(kv)
    return kv


def _make_hicache(cfg: ServerConfig, runner: Any, alloc_slots: Any) -> PrefixCache:
    mc = runner.model_config
    pool = runner.kv_pool
    shape = dict(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=pool.transfer_dtype,  # an fp8 pool's bytes travel as uint8
    )
    on_gpu = runner.device.type == "cuda"
    if cfg.hicache_size > 0:
        host_tokens = HostKVPool.tokens_for_bytes(int(cfg.hicache_size * 2**30), **shape)
    else:
        host_tokens = int(cfg.hicache_ratio * runner.allocator.max_total_tokens)
    host_pool = HostKVPool(host_tokens, cfg.page_size, pin_memory=on_gpu, **shape)
    engine = CudaCopyEngine(runner.device) if on_gpu else SyncCopyEngine()
    controller = HiCacheController(
        *pool.transfer_buffers(), host_pool, engine, layer_loads=pool.layer_loads
    )
    storage = disk_storage(cfg, runner)
    logger.info(
        "hierarchical cache: host pool %d tokens (%.2f GiB), page size %d, policy %s, disk %s",
        host_pool.total_size(),
        host_pool.total_size() * host_pool.bytes_per_token / 2**30,
        cfg.page_size,
        cfg.hicache_write_policy,
        cfg.hicache_storage_dir or "off",
    )
    return HiRadixCache(
        page_size=cfg.page_size,
        free_slots=runner.allocator.free,
        alloc_slots=alloc_slots,
        controller=controller,
        storage=storage,
        write_policy=cfg.hicache_write_policy,
        device=runner.device,
        prefetch_policy=cfg.hicache_storage_prefetch_policy,
    )


def disk_storage(cfg: ServerConfig, runner: Any) -> StorageIO | None:
    """The disk tier's page store for the runner's current weights (None without
    ``--hicache-storage-dir``); after a weight update, a folder of its own."""
    if not cfg.hicache_storage_dir:
        return None
    try:
        store = DiskPageStore(
            cfg.hicache_storage_dir, model_fingerprint(cfg, runner), cfg.hicache_storage_max_bytes
        )
    except OSError as e:
        raise ValueError(
            f"hicache_storage_dir {cfg.hicache_storage_dir!r} cannot hold the disk KV tier: {e}"
        ) from e
    return StorageIO(store, num_read_threads=DISK_READ_THREADS)


def model_fingerprint(cfg: ServerConfig, runner: Any) -> dict[str, object]:
    """What KV pages depend on: the weights (path, files, sizes and modification times: a
    checkpoint rewritten in place is other weights), dtype, quantization, the
    KV cache dtype and its fp8 scales (static per process, but calibration or a scales file may
    choose others in the next one) and the KV layout. Any change starts
    an empty disk tier instead of a wrong hit."""
    mc = runner.model_config
    model_dir = Path(runner.model_dir)
    files = []
    if model_dir.is_dir():
        files = sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in model_dir.iterdir()
            if p.suffix == ".safetensors"
        )
    return {
        "model": str(model_dir.resolve()),
        "weights": files,
        "load_format": cfg.load_format,
        "architecture": mc.architecture,
        "dtype": str(runner.dtype),
        "quantization": cfg.quantization,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        # the resolved scales (calibrated, unit or a file's): a stored byte means value / scale
        "kv_scales": runner.kv_pool.scales_info(),
        "num_layers": mc.num_layers,
        "num_kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "page_size": cfg.page_size,
        "tp_rank": runner.tp.rank,  # each tensor-parallel rank holds other KV heads
        "tp_size": runner.tp.size,
    }
