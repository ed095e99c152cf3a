"""On a GPU, decode batches of up to ``gemv.MAX_ROWS`` rows run each decoder layer as four
weight-streaming kernels plus attention (``kernels/gemv.py``): the logprobs stay those of the
layer-by-layer path (cuBLAS, separate norm and activation kernels) within bf16 rounding, with
CUDA graphs on and off."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.kernels import gemv
from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# a tiny Qwen3-MoE: q/k norms, 8 experts of which 2 a token, layer 1 dense
TINY_MOE = dict(
    TINY_LLAMA,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)


def _run(folder, streaming: bool, graphs: bool, monkeypatch) -> list[tuple]:
    from radixlm.srt import Engine
    from radixlm.srt.models import llama

    monkeypatch.setattr(gemv, "ENABLED", streaming)
    calls = []
    original = llama.stream_attention

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(llama, "stream_attention", counted)
    engine = Engine(
        model_path=str(folder),
        load_format="dummy",
        attention_backend="triton",
        dtype="bfloat16",
        disable_cuda_graph=not graphs,
        max_total_tokens=8192,
        log_level="warning",
    )
    try:
        rng = random.Random(1)
        outs = []
        for n in (3, 40, 150):  # one request at a time: decode batches of one row
            prompt = [rng.randrange(2, TINY_LLAMA["vocab_size"]) for _ in range(n)]
            out = engine.generate(
                input_ids=prompt,
                sampling_params={"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
                return_logprob=True,
            )
            outs.append(out)
        assert engine.scheduler.check_idle()
    finally:
        engine.shutdown()
    assert bool(calls) == streaming
    return [
        (o["output_ids"], [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]) for o in outs
    ]


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_streaming_layers_match_layer_by_layer(tmp_path, monkeypatch, graphs, family):
    if family == "llama":
        folder = make_model_folder(tmp_path, TINY_LLAMA)
    else:
        folder = make_model_folder(tmp_path, TINY_MOE, config_class="Qwen3MoeConfig")
    ref = _run(folder, False, graphs, monkeypatch)
    got = _run(folder, True, graphs, monkeypatch)
    for (ids_a, lps_a), (ids_b, lps_b) in zip(got, ref, strict=True):
        assert ids_a[:4] == ids_b[:4]  # random weights: later near-ties may flip in bf16
        for a, b in zip(lps_a[:4], lps_b[:4], strict=True):
            assert abs(a - b) < 0.05
