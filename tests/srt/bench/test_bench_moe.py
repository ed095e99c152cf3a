"""The MoE benchmark's model folder and limits, without a GPU: the folder is a Qwen3-MoE config
the loader reads, and the active parameters are Qwen3-30B-A3B's (~3.3B with the embedding)."""

from __future__ import annotations

import pytest

from radixlm.srt.bench.bench_gpu import make_model_folder
from radixlm.srt.bench.bench_moe import QWEN3_30B_A3B, active_params, limits
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.moe_decoder import MoEForCausalLM
from radixlm.srt.models.registry import get_model_class


def test_folder_is_a_qwen3_moe_checkpoint(tmp_path):
    folder = make_model_folder(tmp_path, dict(QWEN3_30B_A3B), config_class="Qwen3MoeConfig")
    config = ModelConfig.from_pretrained(folder)
    assert config.architecture == "Qwen3MoeForCausalLM"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (48, 32, 4)
    model_class = get_model_class(config.architecture)
    assert issubclass(model_class, MoEForCausalLM)
    moe = model_class.moe_config(config)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 768)
    assert moe.renormalize and all(moe.is_sparse(i) for i in range(48))


def test_active_parameters_and_limits():
    active = active_params(QWEN3_30B_A3B)
    embedding = QWEN3_30B_A3B["vocab_size"] * QWEN3_30B_A3B["hidden_size"]
    assert (active["decode"] + embedding) / 1e9 == pytest.approx(3.35, abs=0.02)
    out = limits(QWEN3_30B_A3B, {"copy_bandwidth_TBps": 4.0, "bf16_matmul_TFLOPs": 800.0})
    assert out["active_roofline_ms_per_token"] == pytest.approx(2 * active["decode"] / 4e9)
    assert out["prefill_flop_limit_tok_s"] == pytest.approx(800e12 / (2 * active["prefill"]))
