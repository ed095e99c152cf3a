"""``--kv-cache-dtype fp8_*`` in the runner: validation, pool sizing by the storage dtype, the
disk-tier fingerprint, the reports; and the engine on a tiny model (greedy runs, no KV leak,
with and without the host tier)."""

from __future__ import annotations

import logging

import pytest
import torch

from radixlm.srt import Engine
from radixlm.srt.config import config_from_kwargs
from radixlm.srt.executor.memory_pool import kv_storage_dtype
from radixlm.srt.executor.model_runner import ModelRunner
from radixlm.srt.scheduler.cache_factory import model_fingerprint

CPU = torch.device("cpu")


def test_kv_storage_dtype_choices_and_refusals(monkeypatch):
    assert kv_storage_dtype("auto", torch.bfloat16, "none", CPU) == torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.float32, "none", CPU) == torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2", torch.bfloat16, "none", CPU) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3 cannot be combined with .*int4"):
        kv_storage_dtype("fp8_e4m3", torch.float32, "int4", CPU)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_storage_dtype("int8", torch.float32, "none", CPU)
    # a GPU without fp8 conversions (compute capability 8.0) is refused before any allocation
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp8_e5m2 needs a GPU .* 8\.9"):
        kv_storage_dtype("fp8_e5m2", torch.bfloat16, "none", torch.device("cuda"))


def _runner(model_dir, **opts) -> ModelRunner:
    cfg = config_from_kwargs(
        model_path=str(model_dir), device="cpu", max_running_requests=4, **opts
    )
    return ModelRunner(cfg)


def test_fp8_pool_holds_four_times_the_float32_tokens(tiny_llama_dir, caplog):
    plain = _runner(tiny_llama_dir, mem_budget_gb=0.001)
    with caplog.at_level(logging.INFO, logger="radixlm.srt.executor.model_runner"):
        fp8 = _runner(tiny_llama_dir, mem_budget_gb=0.001, kv_cache_dtype="fp8_e4m3")
    assert plain.kv_pool.storage_dtype == torch.float32
    assert fp8.kv_pool.storage_dtype == torch.float8_e4m3fn
    assert fp8.kv_pool.dtype == torch.float32  # compute dtype: the model's
    assert fp8.kv_pool.k_buffers[0].element_size() == 1
    # float32 -> one byte per value: four times the slots in the same budget (page rounding)
    assert abs(fp8.max_total_tokens - 4 * plain.max_total_tokens) <= 4
    assert any("tokens of torch.float8_e4m3fn" in r.getMessage() for r in caplog.records)
    # a disk tier written with one KV dtype is never read by the other
    assert model_fingerprint(plain.cfg, plain) != model_fingerprint(fp8.cfg, fp8)
    assert model_fingerprint(fp8.cfg, fp8)["kv_cache_dtype"] == "fp8_e4m3"


def test_engine_refuses_fp8_with_int4(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(
            model_path=str(tiny_llama_dir),
            device="cpu",
            quantization="int4",
            kv_cache_dtype="fp8_e4m3",
            max_total_tokens=256,
            log_level="warning",
        )


WORDS = "river mountain lantern copper violet orchard harbor meadow signal quiet ember".split()
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.mark.parametrize("hicache", [False, True])
def test_tiny_engine_with_fp8_kv_runs_and_leaks_nothing(tiny_llama_dir, hicache, tiers_always_load):
    """Prefill, decode and prefix reuse over an fp8 pool: five ~70-token prompts, one at a
    time, overflow a 192-token device pool, so a second pass finds its prefixes evicted (and,
    with ``hicache``, loads them back from the host tier): outputs are the same both times
    and every slot of every tier comes back."""
    extra = {}
    if hicache:
        extra = dict(enable_hierarchical_cache=True, hicache_write_policy="write_through")
    engine = Engine(
        model_path=str(tiny_llama_dir),
        device="cpu",
        kv_cache_dtype="fp8_e5m2",
        max_total_tokens=192,
        page_size=16,
        log_level="warning",
        **extra,
    )
    prompts = [" ".join(WORDS[i:] + WORDS[:i]) * 6 for i in range(5)]
    try:
        first = [engine.generate(p, GREEDY)["output_ids"] for p in prompts]
        again = [engine.generate(p, GREEDY)["output_ids"] for p in prompts]
        assert again == first and all(len(ids) == 8 for ids in first)
        info = engine.get_server_info()
        assert info["kv_dtype"] == "float8_e5m2" and info["dtype"] == "float32"
        if hicache:
            assert info["hicache"]["host_hit_tokens"] > 0, info["hicache"]
        assert engine.scheduler.check_idle()
    finally:
        engine.shutdown()
