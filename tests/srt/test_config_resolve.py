"""``config.resolve``: every start-up ``auto`` becomes concrete, once, and the runner uses it."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from radixlm.kernels.attention.registry import ATTENTION_BACKEND_NAMES
from radixlm.srt.config import AUTO_IS_A_MODE, ServerConfig, config_from_kwargs, resolve
from radixlm.srt.executor.model_runner import ModelRunner

HAS_CUDA = torch.cuda.is_available()


def _auto_fields(cfg: ServerConfig) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(cfg)
        if getattr(cfg, f.name) == "auto" and f.name not in AUTO_IS_A_MODE
    ]


def test_resolve_leaves_no_auto_placeholder():
    cfg = ServerConfig()
    # the defaults hold placeholders; any new auto field must be resolved or listed as a mode
    assert _auto_fields(cfg) == ["dtype", "device", "attention_backend"]
    resolved = resolve(cfg, head_dim=64)
    assert _auto_fields(resolved) == []
    assert resolved.device == ("cuda" if HAS_CUDA else "cpu")
    assert resolved.dtype == ("bfloat16" if HAS_CUDA else "float32")
    assert resolved.attention_backend in ATTENTION_BACKEND_NAMES
    assert resolve(resolved, head_dim=64) == resolved  # a resolved config stays as it is


def test_resolve_on_cpu_picks_the_cpu_backend_float32_and_keeps_explicit_values():
    from radixlm.kernels import cpu_decode

    resolved = resolve(ServerConfig(device="cpu"))
    assert (resolved.device, resolved.dtype, resolved.attention_backend) == (
        "cpu",
        "float32",
        "cpu" if cpu_decode.available() else "torch",
    )
    assert resolve(ServerConfig(device="cpu", attention_backend="torch")).attention_backend == (
        "torch"
    )
    explicit = resolve(ServerConfig(device="cpu", dtype="bfloat16"))
    assert explicit.dtype == "bfloat16"


def test_mixed_chunks_follow_the_device_unless_told(monkeypatch):
    """Mixed prefill+decode steps: on by default on a CPU and on a GPU with FlashInfer, off on a
    GPU with Triton (measured: docs/results/serving.md); --enable-mixed-chunk /
    --disable-mixed-chunk override either way."""
    from radixlm.srt import config

    assert config.MIXED_CHUNK_BY_DEVICE == {"cpu": True, "cuda": False}
    assert config.mixed_by_default("cuda", "flashinfer") is True
    assert config.mixed_by_default("cuda", "triton") is False
    assert config.mixed_by_default("cpu", "cpu") is config.mixed_by_default("cpu", "torch") is True
    assert resolve(ServerConfig(device="cpu")).disable_mixed_chunk is False
    assert resolve(ServerConfig(device="cpu", disable_mixed_chunk=True)).disable_mixed_chunk
    monkeypatch.setitem(config.MIXED_CHUNK_BY_DEVICE, "cpu", False)  # as on a GPU
    off = resolve(ServerConfig(device="cpu"))
    assert off.disable_mixed_chunk is True and resolve(off) == off
    on = resolve(ServerConfig(device="cpu", enable_mixed_chunk=True))
    assert on.disable_mixed_chunk is False and resolve(on) == on
    with pytest.raises(ValueError, match="at most one of enable_mixed_chunk"):
        config_from_kwargs(enable_mixed_chunk=True, disable_mixed_chunk=True)
    # a backend's own default wins over its device's, and the flags over both
    monkeypatch.setitem(config.MIXED_CHUNK_BY_DEVICE, "cpu", True)
    monkeypatch.setitem(config.MIXED_CHUNK_BY_BACKEND, ("cpu", "torch"), False)
    alone = resolve(ServerConfig(device="cpu", attention_backend="torch"))
    assert alone.disable_mixed_chunk is True
    assert (
        resolve(
            ServerConfig(device="cpu", attention_backend="torch", enable_mixed_chunk=True)
        ).disable_mixed_chunk
        is False
    )


def test_resolve_rejects_a_bad_device():
    with pytest.raises(ValueError, match="device must be"):
        resolve(ServerConfig(device="tpu-ish"))


def test_resolved_config_is_logged_once_without_secrets(caplog, tiny_llama_dir):
    cfg = config_from_kwargs(
        model_path=str(tiny_llama_dir),
        device="cpu",
        api_key="s3cret",
        max_total_tokens=256,
        max_running_requests=4,
    )
    with caplog.at_level(logging.INFO, logger="radixlm.srt.config"):
        runner = ModelRunner(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "radixlm.srt.config"]
    assert len(lines) == 1, lines
    assert f"attention_backend='{runner.attn_backend.name}'" in lines[0]
    assert "dtype='float32'" in lines[0]
    assert "s3cret" not in lines[0]
    assert _auto_fields(runner.cfg) == []
    assert (runner.device, runner.dtype) == (torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hicache_ratio": float("inf")}, "hicache_ratio"),
        ({"hicache_ratio": float("nan")}, "hicache_ratio"),
        ({"hicache_ratio": -1.0}, "hicache_ratio"),
        ({"hicache_size": float("nan")}, "hicache_size"),
        ({"hicache_size": -2.0}, "hicache_size"),
        ({"hicache_storage_max_bytes": 0}, "hicache_storage_max_bytes"),
        ({"hicache_write_policy": "sometimes"}, "hicache_write_policy"),
        ({"hicache_storage_dir": "/tmp/kv"}, "needs enable_hierarchical_cache"),
        (
            {"enable_hierarchical_cache": True, "disable_radix_cache": True},
            "needs the prefix cache",
        ),
    ],
)
def test_bad_hicache_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        config_from_kwargs(**options)


def test_hicache_raises_page_size_1_only_and_an_unusable_folder_is_named(tiny_llama_dir, tmp_path):
    from radixlm.srt.scheduler.cache_factory import make_kv_manager

    base = dict(model_path=str(tiny_llama_dir), device="cpu", max_total_tokens=256)
    assert resolve(config_from_kwargs(enable_hierarchical_cache=True, **base)).page_size == 16
    assert (
        resolve(config_from_kwargs(enable_hierarchical_cache=True, page_size=4, **base)).page_size
        == 4
    )
    assert resolve(config_from_kwargs(**base)).page_size == 1
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = config_from_kwargs(
        enable_hierarchical_cache=True, hicache_storage_dir=str(blocker / "kv"), **base
    )
    runner = ModelRunner(cfg)
    with pytest.raises(ValueError, match="hicache_storage_dir"):
        make_kv_manager(runner.cfg, runner)


def test_a_mixed_step_cap_turns_mixed_steps_on_and_is_checked(monkeypatch):
    """--mixed-chunk-size / --mixed-step-target-ms cap mixed steps, so either one turns them on
    where the device default is off; with --disable-mixed-chunk they are refused by name."""
    from radixlm.srt import config

    monkeypatch.setitem(config.MIXED_CHUNK_BY_DEVICE, "cpu", False)  # as on a GPU
    for caps in ({"mixed_chunk_size": 2048}, {"mixed_step_target_ms": 40.0}):
        on = resolve(ServerConfig(device="cpu", **caps))
        assert on.disable_mixed_chunk is False and resolve(on) == on
        with pytest.raises(ValueError, match="not with disable_mixed_chunk"):
            config_from_kwargs(disable_mixed_chunk=True, **caps)
    with pytest.raises(ValueError, match="mixed_chunk_size must be >= 1"):
        config_from_kwargs(mixed_chunk_size=0)
    with pytest.raises(ValueError, match="mixed_step_target_ms must be > 0"):
        config_from_kwargs(mixed_step_target_ms=0.0)
    with pytest.raises(ValueError, match="tpot_target_ms must be > 0"):
        config_from_kwargs(tpot_target_ms=-1.0)
