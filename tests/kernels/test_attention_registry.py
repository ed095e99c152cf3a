"""Backend selection by name: auto resolution and clear errors for what a machine lacks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixlm.kernels.attention import registry
from radixlm.kernels.attention.cpu_backend import CpuAttentionBackend
from radixlm.kernels.attention.torch_backend import TorchAttentionBackend

CPU = torch.device("cpu")


def test_auto_on_cpu_is_cpu_where_its_kernels_build_else_torch(monkeypatch):
    if registry.cpu_decode.available():
        assert registry.resolve_attention_backend("auto", CPU) == "cpu"
        assert isinstance(registry.make_attention_backend("auto", CPU), CpuAttentionBackend)
    monkeypatch.setattr(registry.cpu_decode, "available", lambda: False)
    assert registry.resolve_attention_backend("auto", CPU) == "torch"
    assert isinstance(registry.make_attention_backend("auto", CPU), TorchAttentionBackend)
    with pytest.raises(ValueError, match="attention-backend torch"):
        registry.make_attention_backend("cpu", CPU)


def test_auto_on_cuda_prefers_flashinfer_then_triton(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(registry, "flashinfer_available", lambda: True)
    assert registry.resolve_attention_backend("auto", cuda) == "flashinfer"
    monkeypatch.setattr(registry, "triton_available", lambda: True)
    assert registry.resolve_attention_backend("auto", cuda, head_dim=32) == "triton"
    assert registry.resolve_attention_backend("auto", cuda, dtype=torch.float32) == "triton"
    assert registry.resolve_attention_backend("auto", cuda, 128, torch.bfloat16) == "flashinfer"
    monkeypatch.setattr(registry, "flashinfer_available", lambda: False)
    assert registry.resolve_attention_backend("auto", cuda) == "triton"
    monkeypatch.setattr(registry, "triton_available", lambda: False)
    assert registry.resolve_attention_backend("auto", cuda) == "torch"


def test_explicit_names_are_kept():
    for name in ("torch", "cpu", "triton", "flashinfer"):
        assert registry.resolve_attention_backend(name, CPU) == name


def test_unknown_name_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend"):
        registry.make_attention_backend("xformers", CPU)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        registry.make_attention_backend("triton", CPU)


def test_flashinfer_needs_shape_and_cuda():
    with pytest.raises(ValueError, match="num_heads"):
        registry.make_attention_backend("flashinfer", CPU)
    with pytest.raises(ValueError, match="CUDA"):
        registry.make_attention_backend("flashinfer", CPU, num_heads=4, num_kv_heads=2, head_dim=64)


def test_flashinfer_rejects_head_dims_it_has_no_kernels_for():
    with pytest.raises(ValueError, match="head_dim 64, 128, 256, the model has 32"):
        registry.make_attention_backend("flashinfer", CPU, num_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="no torch.float32 kernels"):
        registry.make_attention_backend(
            "flashinfer", CPU, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32
        )


def test_only_backends_with_sinks_serve_models_with_attention_sinks():
    from radixlm.kernels.attention.base import check_backend_serves
    from radixlm.kernels.attention.triton_backend import TritonAttentionBackend

    class SinkLayer(torch.nn.Module):
        layer_id, scaling = 0, 1.0

        def __init__(self, sinks):
            super().__init__()
            self.sinks = sinks

    with_sinks, plain = SinkLayer(torch.zeros(4)), SinkLayer(None)
    check_backend_serves(TorchAttentionBackend(), with_sinks)
    assert TritonAttentionBackend.supports_sinks is True
    check_backend_serves(TritonAttentionBackend.__new__(TritonAttentionBackend), with_sinks)
    other = SimpleNamespace(name="nosinks", supports_sinks=False)  # what the check reads
    check_backend_serves(other, plain)
    with pytest.raises(ValueError, match="sinks.*nosinks.*--attention-backend triton"):
        check_backend_serves(other, with_sinks)


def test_auto_avoids_flashinfer_for_a_model_with_sinks(monkeypatch):
    monkeypatch.setattr(registry, "flashinfer_available", lambda: True)
    monkeypatch.setattr(registry, "triton_available", lambda: True)
    cuda = torch.device("cuda")
    assert registry.resolve_attention_backend("auto", cuda, 64, torch.bfloat16) == "flashinfer"
    assert registry.resolve_attention_backend("auto", cuda, 64, torch.bfloat16, True) == "triton"
