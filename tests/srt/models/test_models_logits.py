"""Our implementations (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, and the MoE families
Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss) give transformers' logits on the same checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from model_batches import KVSession, max_rel_err, run_logits
from tiny_checkpoints import CHECKPOINTS, VOCAB, hf_logits, write_checkpoint

from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.models.loader import load_model
from radixlm.srt.models.model_config import ModelConfig
from radixlm.srt.models.registry import get_model_class, supported_architectures

PROMPT = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()


def our_logits(folder, input_ids: list[int]) -> torch.Tensor:
    model = load_model(folder, torch.float32, "cpu")
    session = KVSession(model.config)
    return run_logits(model, session, ForwardMode.EXTEND, [(session.new_request(), input_ids)])


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_logits_match_transformers(name, tmp_path):
    folder = write_checkpoint(name, tmp_path)
    ref = hf_logits(folder, PROMPT)
    ours = our_logits(folder, PROMPT)
    assert ours.dtype == torch.float32 and ours.shape == (len(PROMPT), VOCAB)
    assert max_rel_err(ours, ref) < 1e-4


def test_config_reads_rope_head_dim_eos_and_dtype(tmp_path):
    folder = write_checkpoint("qwen3_qk_norm", tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = ModelConfig.from_pretrained(folder)
    assert (config.architecture, config.head_dim, config.num_kv_heads) == (
        "Qwen3ForCausalLM",
        32,
        2,
    )
    assert config.eos_token_ids == (2, 7)
    assert config.rope_theta == 1e6 and config.rope_scaling is None
    assert config.dtype == torch.float32
    llama3 = ModelConfig.from_pretrained(write_checkpoint("llama3_rope_sharded", tmp_path / "l3"))
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.rope_scaling["factor"] == 8.0


def test_checkpoint_without_lm_head_shares_the_embedding(tmp_path):
    folder = write_checkpoint("llama_tied", tmp_path)
    ref = hf_logits(folder, PROMPT)
    config_file = folder / "config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "tie_word_embeddings": False})
    )
    model = load_model(folder, torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    session = KVSession(model.config)
    ours = run_logits(model, session, ForwardMode.EXTEND, [(session.new_request(), PROMPT)])
    assert max_rel_err(ours, ref) < 1e-4


def test_bfloat16_model_is_close_to_float32(tmp_path):
    folder = write_checkpoint("llama", tmp_path)
    ref = our_logits(folder, PROMPT)
    model = load_model(folder, torch.bfloat16, "cpu")
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.rotary_emb.cos_cache.dtype == torch.float32
    session = KVSession(model.config, dtype=torch.bfloat16)
    ours = run_logits(model, session, ForwardMode.EXTEND, [(session.new_request(), PROMPT)])
    assert ours.dtype == torch.float32
    assert max_rel_err(ours, ref) < 5e-2
    assert torch.get_default_dtype() == torch.float32  # construction restored the default


@pytest.mark.parametrize("name", ["gemma2_softcap", "gemma3_local_global"])
def test_gemma_bfloat16_is_close_to_transformers(name, tmp_path):
    """bfloat16 through Gemma's (1 + weight) norms, rounded embedding scale and soft-caps."""
    folder = write_checkpoint(name, tmp_path)
    ref = hf_logits(folder, PROMPT)
    model = load_model(folder, torch.bfloat16, "cpu")
    session = KVSession(model.config, dtype=torch.bfloat16)
    ours = run_logits(model, session, ForwardMode.EXTEND, [(session.new_request(), PROMPT)])
    assert max_rel_err(ours, ref) < 5e-2


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_checkpoint("llama", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(folder, torch.float32, "cpu")


def test_wrong_shape_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_checkpoint("llama", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"up_proj\.weight.*shape \(64, 64\), expected \(128, 64\)"
    ):
        load_model(folder, torch.float32, "cpu")


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported") as err:
        get_model_class("GPT2LMHeadModel")
    named = str(err.value).split("supported architectures: ")[1].split(", ")
    assert named == supported_architectures()
    assert {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "OlmoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "GptOssForCausalLM",
    } <= set(named)


def test_unknown_rope_type_is_rejected(tmp_path):
    from radixlm.srt.models.layers import rope_inv_freq

    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        rope_inv_freq(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_rope_matches_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from radixlm.srt.models.layers import rope_attention_factor, rope_inv_freq

    params = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": truncate,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    }
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(rope_parameters=params), "cpu")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    torch.testing.assert_close(rope_inv_freq(64, 150000.0, scaling), inv_freq)
    assert rope_attention_factor(scaling) == pytest.approx(factor)
    assert rope_attention_factor(None) == 1.0


def test_gpt_oss_quantized_checkpoint_is_refused_by_name(tmp_path):
    folder = write_checkpoint("gpt_oss", tmp_path)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config .'mxfp4'. is not supported"):
        load_model(folder, torch.float32, "cpu")


def test_gpt_oss_config_without_swiglu_alpha_uses_the_published_slope(tmp_path):
    """The published gpt-oss configs give swiglu_limit only (older transformers have no
    swiglu_alpha field): the slope is then 1.702, as transformers computes it."""
    folder = write_checkpoint("gpt_oss", tmp_path)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    assert config.pop("swiglu_alpha", 1.702) == 1.702
    config_file.write_text(json.dumps(config))
    assert max_rel_err(our_logits(folder, PROMPT), hf_logits(folder, PROMPT)) < 1e-4
    config["swiglu_alpha"] = 1.0  # a config that gives it is followed
    config_file.write_text(json.dumps(config))
    assert max_rel_err(our_logits(folder, PROMPT), hf_logits(folder, PROMPT)) < 1e-4


@pytest.mark.parametrize("rank", [0, 1])
def test_phi3_fused_tensors_split_per_rank(rank, tmp_path):
    """Each tensor-parallel rank of Phi-3 keeps, from the fused qkv_proj/gate_up_proj read as
    lazy slices, the rows a Llama rank keeps from the same tensors stored apart."""
    from radixlm.srt.distributed import TPGroup
    from radixlm.srt.models.llama import LlamaForCausalLM
    from radixlm.srt.models.loader import iter_safetensors

    folder = write_checkpoint("phi3_fused_window", tmp_path)
    config = ModelConfig.from_pretrained(folder)
    tp = TPGroup(rank=rank, size=2)
    phi3 = get_model_class("Phi3ForCausalLM")(config, torch.float32, "cpu", tp=tp)
    phi3.load_weights(iter_safetensors(folder, lazy=True))
    d, inter = config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    apart = {}
    for name, tensor in iter_safetensors(folder):
        if ".qkv_proj." in name:
            for part, rows in zip(("q", "k", "v"), tensor.split([q, kv, kv]), strict=True):
                apart[name.replace(".qkv_proj.", f".{part}_proj.")] = rows
        elif ".gate_up_proj." in name:
            for part, rows in zip(("gate", "up"), tensor.split([inter, inter]), strict=True):
                apart[name.replace(".gate_up_proj.", f".{part}_proj.")] = rows
        else:
            apart[name] = tensor
    llama = LlamaForCausalLM(config, torch.float32, "cpu", tp=tp)
    llama.load_weights(apart.items())
    ours, theirs = dict(phi3.named_parameters()), dict(llama.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert ours["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == (q + 2 * kv) // 2


@pytest.mark.parametrize(
    "name,field,value,message",
    [
        ("gemma2_softcap", "hidden_activation", "relu", "hidden activation 'relu'"),
        ("gemma3_local_global", "use_bidirectional_attention", True, "bidirectional"),
        ("phi3_fused_window", "partial_rotary_factor", 0.75, "partial_rotary_factor 0.75"),
    ],
)
def test_unsupported_options_are_refused_by_name(name, field, value, message, tmp_path):
    folder = write_checkpoint(name, tmp_path)
    config_file = folder / "config.json"
    raw = json.loads(config_file.read_text())
    raw[field] = value
    if field == "partial_rotary_factor" and isinstance(raw.get("rope_parameters"), dict):
        raw["rope_parameters"][field] = value
    config_file.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        load_model(folder, torch.float32, "cpu")
