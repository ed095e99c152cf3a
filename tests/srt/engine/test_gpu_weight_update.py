"""On a GPU with CUDA graphs: update_weights_from_disk copies into the tensors the captured
graphs read, so graph replays after an update give the outputs of an engine started on the new
weights, at batch sizes inside and beyond a ``cuda_graph_max_bs`` cap (the eager path)."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import save_file

from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder

pytestmark = pytest.mark.gpu

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
CAP = 4  # graphs for batches up to 4; a batch of 8 runs eagerly


def _checkpoint(folder, seed: int):
    """A Llama checkpoint of TINY_LLAMA's shape with sharp random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    make_model_folder(folder, TINY_LLAMA)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder)).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # sharp logits: no bf16 near-ties between two runs
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(2, TINY_LLAMA["vocab_size"]) for _ in range(5 + 7 * i)] for i in range(8)
    ]


def _run(engine, prompts) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def _engine(path: str):
    from radixlm.srt import Engine

    return Engine(
        model_path=path,
        attention_backend="triton",
        dtype="bfloat16",
        cuda_graph_max_bs=CAP,
        max_total_tokens=8192,
        log_level="warning",
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replays_read_the_updated_weights(tmp_path):
    first = _checkpoint(tmp_path / "first", seed=1)
    second = _checkpoint(tmp_path / "second", seed=2)
    prompts = _prompts()
    with _engine(str(second)) as fresh:
        want_second = (_run(fresh, prompts[:CAP]), _run(fresh, prompts))
    with _engine(str(first)) as engine:
        assert engine.scheduler.runner.graph_runner is not None
        want_first = (_run(engine, prompts[:CAP]), _run(engine, prompts))
        assert want_first != want_second  # the two checkpoints answer differently
        ok, message, _ = engine.update_weights_from_disk(str(second))
        assert ok, message
        assert (_run(engine, prompts[:CAP]), _run(engine, prompts)) == want_second
        ok, message, _ = engine.update_weights_from_disk(str(first))
        assert ok, message
        assert (_run(engine, prompts[:CAP]), _run(engine, prompts)) == want_first
        assert engine.scheduler.check_idle()
        u = engine.scheduler.kv.usage()
        assert u["available"] + u["evictable"] + u["protected"] == u["max_total_tokens"], u
