"""A quantised checkpoint through the in-process Engine (CPU): it generates, and the load-time
accuracy check reaches ``get_server_info()`` (the same figures ``/server_info`` serves) unless
``quantization_check`` is off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from quant_checkpoints import write_quantised  # noqa: E402


@pytest.fixture(scope="module")
def gptq_folder(tmp_path_factory, default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    root = tmp_path_factory.mktemp("engine_quant")
    folder, _ = write_quantised(
        "gptq_g32_actorder", root / "q", root / "r", vocab_size=len(tokenizer)
    )
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("check", ["on", "off"])
def test_engine_reports_the_check_in_server_info(gptq_folder, check):
    from radixlm.srt.engine import Engine

    engine = Engine(
        model_path=str(gptq_folder), device="cpu", max_total_tokens=2048, quantization_check=check
    )
    try:
        out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4})
        assert len(out["output_ids"]) == 4
        info = engine.get_server_info()
        if check == "off":
            assert "quantization_report" not in info
            return
        report = info["quantization_report"]
        assert report["scheme"] == "gptq:int4-g32-sym-actorder"
        assert report["tokens"] > 100
        assert report["mean_kl"] < 1e-6 and report["top1_agreement"] == 1.0  # CPU: same matmul
    finally:
        engine.shutdown()
