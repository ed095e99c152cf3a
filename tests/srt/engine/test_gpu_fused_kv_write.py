"""On a GPU the fused rope kernel writes the new tokens' K/V into the pool itself
(``fused.rope_qkv_store``): the same pool bytes, so the same logprobs, as the unfused path
(rope split, then the attention backend's ``set_kv``), with bf16 and fp8 KV."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = TINY_LLAMA


def _run(folder, kv_dtype: str, fused_store: bool, backend: str) -> list[tuple]:
    from radixlm.srt import Engine

    engine = Engine(
        model_path=str(folder),
        load_format="dummy",
        attention_backend=backend,
        dtype="bfloat16",
        kv_cache_dtype=kv_dtype,
        disable_cuda_graph=True,  # the flag below must reach every step
        max_total_tokens=8192,
        log_level="warning",
    )
    try:
        runner = engine.scheduler.runner
        if not fused_store:  # the unfused path: every write goes through set_kv
            pool = runner.kv_pool
            pool.direct_write_target = lambda layer_id: None
        rng = random.Random(1)
        prompts = [[rng.randrange(2, SHAPE["vocab_size"]) for _ in range(n)] for n in (3, 40, 150)]
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
            return_logprob=True,
        )
        assert engine.scheduler.check_idle()
        return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_kv_write_equals_set_kv(tmp_path, kv_dtype, backend):
    folder = make_model_folder(tmp_path, SHAPE)
    assert _run(folder, kv_dtype, True, backend) == _run(folder, kv_dtype, False, backend)
