"""The accuracy check of quantised models at load: KL and top-1 agreement are computed right,
the check measures a pre-quantised checkpoint against its dequantised weights and
``--quantization fp8`` against the checkpoint's own weights, and ``off`` skips it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from radixlm.srt.executor.quant_check import check_quantisation, compare, quantise_and_check
from radixlm.srt.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from quant_checkpoints import write_quantised  # noqa: E402

IDS = [5, 17, 42, 99, 7, 250, 3, 11, 64, 128, 200, 31, 8, 9, 10, 77]


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 300 for c in text[:64]]


def test_compare_gives_zero_kl_and_full_agreement_for_equal_logits():
    logits = torch.randn(6, 50)
    assert compare(logits, logits) == pytest.approx({"mean_kl": 0.0, "top1_agreement": 1.0})


def test_compare_matches_the_kl_formula_and_counts_argmax_changes():
    ref, q = torch.randn(4, 10), torch.randn(4, 10)
    q[:2] = ref[:2]
    p = torch.softmax(ref, -1)
    kl = (p * (p.log() - torch.log_softmax(q, -1))).sum(-1).mean()
    got = compare(ref, q)
    assert got["mean_kl"] == pytest.approx(float(kl), rel=1e-5)
    assert got["top1_agreement"] == pytest.approx(
        float((ref.argmax(-1) == q.argmax(-1)).float().mean())
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_check")
    fp8, ref = write_quantised("ct_fp8_channel", root / "fp8", root / "ref")
    awq, _ = write_quantised("awq_g128", root / "awq", root / "ref_awq")
    return {"fp8": fp8, "ref": ref, "awq": awq}


def test_a_prequantised_checkpoint_is_checked_against_its_dequantised_weights(folders):
    cpu = torch.device("cpu")
    int4 = load_model(folders["awq"], torch.float32, cpu)
    report = check_quantisation(int4, IDS, 2, cpu)
    assert report["scheme"].startswith("awq:int4-g128")
    assert report["mean_kl"] < 1e-9 and report["top1_agreement"] == 1.0  # CPU: same matmul
    fp8 = load_model(folders["fp8"], torch.float32, cpu)
    report = check_quantisation(fp8, IDS, 2, cpu)
    assert report["tokens"] == len(IDS)
    assert 0 < report["mean_kl"] < 0.05  # the activations' FP8 rounding


def test_quantization_fp8_is_checked_against_the_checkpoints_weights(folders):
    cpu = torch.device("cpu")
    model = load_model(folders["ref"], torch.float32, cpu)
    cfg = SimpleNamespace(quantization="fp8", quantization_check="on")
    report = quantise_and_check(model, cfg, _Tokenizer(), model.config, 2, cpu)
    assert report["scheme"] == "fp8-at-load:fp8-channel-act-token"
    assert report["reference"] == "the checkpoint's weights"
    assert 0 < report["mean_kl"] < 0.05 and report["top1_agreement"] > 0.5
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn


def test_check_off_quantises_without_checking(folders):
    cpu = torch.device("cpu")
    model = load_model(folders["ref"], torch.float32, cpu)
    cfg = SimpleNamespace(quantization="fp8", quantization_check="off")
    assert quantise_and_check(model, cfg, _Tokenizer(), model.config, 2, cpu) is None
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    prequantised = load_model(folders["awq"], torch.float32, cpu)
    cfg = SimpleNamespace(quantization="none", quantization_check="off")
    assert quantise_and_check(prequantised, cfg, _Tokenizer(), model.config, 2, cpu) is None


def test_quantising_a_quantised_checkpoint_again_is_refused(folders):
    model = load_model(folders["awq"], torch.float32, "cpu")
    cfg = SimpleNamespace(quantization="fp8", quantization_check="off")
    with pytest.raises(ValueError, match="quantised already"):
        quantise_and_check(model, cfg, _Tokenizer(), model.config, 2, torch.device("cpu"))


def test_config_accepts_fp8_on_any_device_and_the_check_switch():
    from radixlm.srt.cli import build_parser
    from radixlm.srt.config import config_from_args, config_from_kwargs

    assert config_from_kwargs(quantization="fp8", device="cuda").quantization == "fp8"
    with pytest.raises(ValueError, match="CPU only"):
        config_from_kwargs(quantization="int4", device="cuda")
    with pytest.raises(ValueError, match="quantization_check must be one of"):
        config_from_kwargs(quantization_check="maybe")
    args = build_parser().parse_args(
        ["serve", "--quantization", "fp8", "--quantization-check", "off"]
    )
    cfg = config_from_args(args)
    assert (cfg.quantization, cfg.quantization_check) == ("fp8", "off")
