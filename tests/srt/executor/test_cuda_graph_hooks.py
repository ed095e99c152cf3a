"""The CUDA-graph hooks of the attention contract decide capture; no code asks a backend's name.

These run on a CPU: the decision (``should_capture``) and the refusal in ``CudaGraphRunner``
happen before anything touches a GPU.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.attention.base import AttentionBackend
from radixlm.kernels.attention.torch_backend import TorchAttentionBackend
from radixlm.kernels.attention.triton_backend import TritonAttentionBackend
from radixlm.srt.config import config_from_kwargs
from radixlm.srt.executor.cuda_graph import CudaGraphRunner, should_capture
from radixlm.srt.executor.model_runner import ModelRunner

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it
HOOKS = ("init_cuda_graph_state", "plan_for_capture", "plan_for_replay")


def test_backend_without_graph_support_is_never_captured():
    torch_backend = TorchAttentionBackend()
    assert not torch_backend.supports_cuda_graph
    assert not should_capture(CUDA, torch_backend, disabled=False)
    assert should_capture(CUDA, TritonAttentionBackend(), disabled=False)
    assert not should_capture(CUDA, TritonAttentionBackend(), disabled=True)
    assert not should_capture(torch.device("cpu"), TritonAttentionBackend(), disabled=False)


def test_graph_hooks_of_a_backend_without_support_raise():
    backend = TorchAttentionBackend()
    with pytest.raises(NotImplementedError, match="torch attention backend"):
        backend.init_cuda_graph_state(4, 64)
    for hook in ("plan_for_capture", "plan_for_replay"):
        with pytest.raises(NotImplementedError, match="no CUDA-graph support"):
            getattr(backend, hook)(None)


def test_backends_that_claim_graph_support_implement_every_hook():
    from radixlm.kernels.attention.flashinfer_backend import FlashInferAttentionBackend

    for cls in (TritonAttentionBackend, FlashInferAttentionBackend):
        assert cls.supports_cuda_graph, cls
        for hook in HOOKS:
            assert getattr(cls, hook) is not getattr(AttentionBackend, hook), (cls, hook)


def test_graph_runner_refuses_a_backend_without_support(tiny_llama_dir):
    runner = ModelRunner(
        config_from_kwargs(
            model_path=str(tiny_llama_dir),
            log_level="warning",
            max_total_tokens=256,
            max_running_requests=4,
        )
    )
    assert runner.graph_runner is None
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        CudaGraphRunner(runner, 4)
