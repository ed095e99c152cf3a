"""The MoE benchmark without a GPU: the folder is a Qwen3-MoE config the loader reads, the
active parameters are Qwen3-30B-A3B's (~3.3B with the embedding), the phases (each its own
process) report even when one fails, and the profile names the MoE kernels."""

from __future__ import annotations

import json

import pytest

from radixlm.srt.bench.bench_gpu import make_model_folder
from radixlm.srt.bench.bench_moe import QWEN3_30B_A3B, active_params, combine, limits
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


def test_kernel_categories_name_the_moe_kernels():
    from radixlm.srt.bench.decode_profile import category

    assert category("_small_gate_up_kernel") == "moe experts"
    assert category("_small_down_kernel") == "moe experts"
    assert category("_down_kernel") == "moe experts"
    assert category("_route_kernel") == "moe routing"
    assert category("_decode_partial_kernel") == "attention"
    assert category("_rope_qkv_kernel") == "norm/rope/act"


def test_combine_sets_the_phases_against_each_other():
    results = {
        "calib": {"active_roofline_ms_per_token": 2.0},
        "engine": {"itl_ms_b1": 3.0, "decode_tok_s_b64": 3200.0},
        "engine_no_graphs": {"itl_ms_b1": 5.0},
        "experts": {"expert_ms_b1": 0.01, "expert_ms_b64": 0.2, "expert_ms_b256": 0.5},
    }
    combine(results, QWEN3_30B_A3B, [64, 256])
    assert results["engine"]["itl_over_roofline"] == pytest.approx(1.5)
    assert results["engine_no_graphs"]["itl_over_roofline"] == pytest.approx(2.5)
    assert results["experts_b1"]["expert_share"] == pytest.approx(48 * 0.01 / 3.0)
    assert results["experts_b64"]["step_ms"] == pytest.approx(20.0)  # 64 / 3,200 tok/s
    assert results["experts_b64"]["expert_ms_per_step"] == pytest.approx(48 * 0.2)
    assert "experts_b256" not in results  # no engine figure at 256 to set it against


def test_every_phase_reports_when_one_fails(tmp_path, monkeypatch):
    """Each phase is its own process; the parent passes calib's bandwidth on, keeps going past
    a failed phase and writes the JSON after every phase."""
    from radixlm.srt.bench import bench_moe

    seen = []

    def fake_child(name, argv, bandwidth):
        seen.append((name, bandwidth))
        if name == "engine_no_graphs":
            return {"error": "CUDA out of memory"}
        return {
            "calib": {
                "device": "card",
                "copy_bandwidth_TBps": 3.0,
                "active_roofline_ms_per_token": 2.0,
            },
            "engine": {"itl_ms_b1": 4.0},
            "experts": {"expert_ms_b1": 0.02},
        }[name]

    monkeypatch.setattr(bench_moe, "_child", fake_child)
    out = tmp_path / "moe.json"
    bench_moe.main(["--json", str(out)])
    assert seen == [("calib", None), ("engine", 3.0), ("engine_no_graphs", 3.0), ("experts", 3.0)]
    written = json.loads(out.read_text())
    assert written["device"] == "card" and "error" in written["engine_no_graphs"]
    assert written["engine"]["itl_over_roofline"] == pytest.approx(2.0)
    assert written["experts_b1"]["expert_share"] == pytest.approx(48 * 0.02 / 4.0)
    with pytest.raises(SystemExit):
        bench_moe.main(["--phases", "engine,nope"])


@pytest.mark.slow  # starts an interpreter (about 5 s)
def test_a_phase_runs_in_a_child_process(tmp_path):
    """The child's command line round trip: a phase it does not know comes back as an error."""
    from radixlm.srt.bench.bench_moe import _child

    out = _child("nope", ["--folder", str(tmp_path / "model")], 3.0)
    assert "unknown phase 'nope'" in out["error"]
