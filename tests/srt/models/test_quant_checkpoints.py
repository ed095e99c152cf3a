"""Quantised checkpoints on the CPU, one tiny random Llama per on-disk format (written by
``quant_checkpoints.py``): the loaded layers dequantise to exactly the writer's weights; the
model's logits match the dense checkpoint of those weights (float32) within a stated bound;
greedy ids equal the reference's over 32 steps; malformed ``quantization_config`` fields are
refused by name."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from model_batches import KVSession, max_rel_err, run_logits
from quant_checkpoints import FORMATS, INT4_FORMATS, write_quantised

from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.models.layers import Linear
from radixlm.srt.models.loader import load_model
from radixlm.srt.models.quant.linear import dense_weight, reference_weights, uses_dense_cache
from radixlm.srt.models.quant.scheme import parse_scheme

PROMPT = [5, 17, 42, 99, 7, 250, 3, 11, 64, 128, 200, 31]
NUM_STEPS = 32
# float32 on a CPU. int4 layers multiply by their dequantised weight: the reference's matmul,
# so only summation order differs. FP8 layers also round the activations to e4m3 (3 mantissa
# bits, per token or block; about 2.6% RMS error per matmul of random data): measured 6.3-7.2%
# of the largest logit on these random 2-layer models, whose logits are nearly flat
EXACT_BOUND = 1e-5
FP8_BOUND = 0.1


@pytest.fixture(scope="module", params=sorted(FORMATS))
def loaded(request, tmp_path_factory):
    fmt = request.param
    root = tmp_path_factory.mktemp(fmt)
    folder, ref = write_quantised(fmt, root / "quant", root / "ref")
    model = load_model(folder, torch.float32, "cpu")
    reference = load_model(ref, torch.float32, "cpu")
    return fmt, model, reference


def test_layers_dequantise_to_the_written_weights(loaded):
    fmt, model, reference = loaded
    ref_params = dict(reference.named_parameters())
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            got = dense_weight(module, torch.float32)
            assert torch.equal(got, ref_params[f"{name}.weight"]), (fmt, name)
            count += 1
    assert count == 2 * 4  # qkv, o, gate_up, down per layer


def _logits(model, prompt):
    session = KVSession(model.config)
    slot = session.new_request()
    return run_logits(model, session, ForwardMode.EXTEND, [(slot, prompt)])


def test_logits_match_the_dequantised_reference(loaded):
    fmt, model, reference = loaded
    ref = _logits(reference, PROMPT)
    err = max_rel_err(_logits(model, PROMPT), ref)
    with reference_weights(model):
        assert max_rel_err(_logits(model, PROMPT), ref) < EXACT_BOUND
    bound = EXACT_BOUND if fmt in INT4_FORMATS else FP8_BOUND
    assert err < bound, (fmt, err)
    if fmt not in INT4_FORMATS:
        assert err > 0  # activations are quantised: the FP8 path is not the reference's


@torch.inference_mode()
def _greedy(model, prompt, steps):
    device = next(model.parameters()).device
    dtype = model.model.norm.weight.dtype
    session = KVSession(model.config, dtype=dtype, device=str(device))
    slot = session.new_request()
    fb = session.batch(ForwardMode.EXTEND, [(slot, prompt)])
    out = []
    for _ in range(steps):
        logits = model.compute_logits(model(fb.input_ids, fb.positions, fb))
        out.append(int(logits[-1].argmax()))
        fb = session.batch(ForwardMode.DECODE, [(slot, [out[-1]])])
    return out


def test_greedy_ids_follow_the_reference(loaded):
    """int4: the same ids over 32 steps. FP8: the same ids where the reference's choice is not
    a near tie; checked on every step by teacher-forcing the reference with the quantised
    model's ids: each pick is within the FP8 logit bound of the reference's best logit."""
    fmt, model, reference = loaded
    ids = _greedy(model, PROMPT, NUM_STEPS)
    if fmt in INT4_FORMATS:
        assert ids == _greedy(reference, PROMPT, NUM_STEPS)
        return
    ref = _logits(reference, PROMPT + ids[:-1])[len(PROMPT) - 1 :]
    assert ref.shape[0] == NUM_STEPS
    picked = ref.gather(1, torch.tensor(ids)[:, None])[:, 0]
    gap = (ref.max(dim=1).values - picked) / ref.abs().max()
    assert (gap <= FP8_BOUND).all(), gap.max()
    assert (gap == 0).float().mean() >= 0.75  # most picks are the reference's own


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_model_off_the_cpu_keeps_every_tensor_on_its_device_and_no_dense_copy(fmt, tmp_path):
    """The checkpoint's tensors arrive on the CPU; a model built on another device (``meta``
    here, standing in for a GPU) must end with every parameter and buffer there and no dense
    cache (a CUDA model once kept CPU weights and a CPU dense copy, and its matmuls failed)."""
    folder, _ = write_quantised(fmt, tmp_path / "q", tmp_path / "r")
    model = load_model(folder, torch.bfloat16, "meta")
    layers = [m for m in model.modules() if getattr(m, "quant_kind", None)]
    assert len(layers) == 2 * 4
    assert all(not uses_dense_cache(m) and m.quant_dense is None for m in layers)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert {n: t.device.type for n, t in tensors.items() if t.device.type != "meta"} == {}


def test_a_cpu_model_caches_its_dense_weights(loaded):
    _, model, _ = loaded
    layers = [m for m in model.modules() if getattr(m, "quant_kind", None)]
    assert layers and all(uses_dense_cache(m) and m.quant_dense is not None for m in layers)


# --- refusals -------------------------------------------------------------------------------


def _with(fmt: str, path: list, value) -> dict:
    qc = copy.deepcopy(FORMATS[fmt])
    target = qc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return qc


W = ["config_groups", "group_0", "weights"]
A = ["config_groups", "group_0", "input_activations"]


@pytest.mark.parametrize(
    ("qc", "field"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method"),
        (_with("awq_g128", ["bits"], 3), "bits"),
        (_with("awq_g128", ["group_size"], 48), "group_size"),
        (_with("awq_g128", ["version"], "gemv"), "version"),
        (_with("gptq_g128_sym", ["checkpoint_format"], "marlin"), "checkpoint_format"),
        (_with("gptq_g128_sym", ["bits"], 8), "bits"),
        (_with("fp8_block", ["weight_block_size"], [128]), "weight_block_size"),
        (_with("fp8_block", ["fmt"], "e5m2"), "fmt"),
        (_with("fp8_block", ["activation_scheme"], "static"), "activation_scheme"),
        (_with("ct_fp8_channel", ["format"], "marlin-24"), "format"),
        (_with("ct_fp8_channel", [*W, "num_bits"], 4), "weights.num_bits"),
        (_with("ct_fp8_channel", [*A, "strategy"], "tensor"), "input_activations"),
        (
            _with("ct_fp8_channel", ["config_groups", "group_0", "input_activations"], None),
            "input_activations",
        ),
        (_with("ct_int4_g128", [*W, "symmetric"], False), "weights.symmetric"),
        (_with("ct_int4_g128", [*W, "group_size"], 100), "weights.group_size"),
        (_with("ct_int4_g128", [*W, "actorder"], "weight"), "weights.actorder"),
        (_with("ct_int4_g128", ["config_groups", "group_0", "targets"], ["Attention"]), "targets"),
        (_with("ct_int4_g128", ["quantization_status"], "initialized"), "quantization_status"),
    ],
)
def test_malformed_or_unsupported_configs_are_refused_by_field(qc, field):
    with pytest.raises(ValueError, match=f"quantization_config.*{field}"):
        parse_scheme(qc)


def test_every_written_config_parses():
    for qc in FORMATS.values():
        parse_scheme(qc)


@pytest.mark.parametrize(
    ("fmt", "edit", "message"),
    [
        (
            "awq_g128",
            lambda t: t.update(
                {"model.layers.0.self_attn.q_proj.scales": torch.ones(3, 256).half()}
            ),
            "scales",
        ),
        (
            "fp8_block",
            lambda t: t.update(
                {
                    "model.layers.0.mlp.up_proj.weight": t[
                        "model.layers.0.mlp.up_proj.weight"
                    ].float()
                }
            ),
            "dtype",
        ),
        ("gptq_g128_sym", lambda t: t.pop("model.layers.1.mlp.down_proj.g_idx"), "g_idx"),
    ],
)
def test_malformed_tensors_are_refused(fmt, edit, message, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = write_quantised(fmt, tmp_path / "q", tmp_path / "r")
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_model(folder, torch.float32, "cpu")


def test_a_quantisation_config_without_linear_layers_is_refused(tmp_path):
    folder, _ = write_quantised("awq_g128", tmp_path / "q", tmp_path / "r")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["re:.*"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="covers no linear layer"):
        load_model(folder, torch.float32, "cpu")


# --- GPU: the same checkpoints through the CUDA kernels ---------------------------------------
# bf16 activations and outputs on the device (2^-8 rounding per op over 2 layers) against the
# float32 CPU reference; FP8 adds its activation rounding as on the CPU
GPU_BOUND = {"int4": 3e-2, "fp8": 0.12}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_gpu_logits_match_the_dequantised_reference(fmt, tmp_path):
    folder, ref_folder = write_quantised(fmt, tmp_path / "q", tmp_path / "r")
    reference = load_model(ref_folder, torch.float32, "cpu")
    model = load_model(folder, torch.bfloat16, "cuda")
    session = KVSession(model.config, dtype=torch.bfloat16, device="cuda")
    slot = session.new_request()
    got = run_logits(model, session, ForwardMode.EXTEND, [(slot, PROMPT)]).cpu()
    kind = "int4" if fmt in INT4_FORMATS else "fp8"
    assert max_rel_err(got, _logits(reference, PROMPT)) < GPU_BOUND[kind]
    assert _greedy(model, PROMPT, 4) is not None  # decode rows (GEMV configs) run too
