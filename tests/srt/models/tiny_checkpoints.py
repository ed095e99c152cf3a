"""Tiny randomly initialised Hugging Face checkpoints (2 layers, hidden 64) for model tests;
the Mixture-of-Experts ones have 3-4 layers, 8 experts with top-2 routing (GQA: 4 query heads,
2 KV heads), a shared expert in Qwen2-MoE, and dense layers where the config mixes them."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

GEMMA = dict(  # softcaps small enough to bite on a random model; head_dim != hidden / heads
    num_hidden_layers=4,
    head_dim=32,
    query_pre_attn_scalar=24,
    sliding_window=6,
    final_logit_softcapping=2.0,
    pad_token_id=0,
)
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
LAYERS_3, LAYERS_4 = {"num_hidden_layers": 3}, {"num_hidden_layers": 4}

# name -> (config class name, extra config fields, save_pretrained max_shard_size or None)
CHECKPOINTS = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}, None),
    "llama3_rope_sharded": (
        "LlamaConfig",
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE},
        "40KB",
    ),
    "llama_linear_rope": (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        None,
    ),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}, None),
    "qwen2_bias": ("Qwen2Config", {"rope_theta": 1000000.0}, None),
    "qwen3_qk_norm": ("Qwen3Config", {"head_dim": 32, "rope_theta": 1000000.0}, None),
    "qwen3_bias_tied": (
        "Qwen3Config",
        {"head_dim": 16, "attention_bias": True, "tie_word_embeddings": True},
        None,
    ),
    # sliding windows of 6 keys, shorter than the test prompts; 4 layers
    "mistral_window": (
        "MistralConfig",
        {"num_hidden_layers": 4, "sliding_window": 6, "head_dim": 32},
        None,
    ),
    "phi3_fused_window": (
        "Phi3Config",
        {"num_hidden_layers": 4, "sliding_window": 6, "pad_token_id": 0},
        None,
    ),
    "gemma2_softcap": ("Gemma2Config", {**GEMMA, "attn_logit_softcapping": 1.5}, None),
    "gemma3_local_global": (
        "Gemma3TextConfig",
        {
            **GEMMA,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "num_hidden_layers": 6,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
        None,
    ),
    # Mixture of Experts: 8 experts, top-2
    "qwen3_moe_mixed": (  # layer 1 dense (mlp_only_layers), softmax top-2 renormalised
        "Qwen3MoeConfig",
        {**MOE, "head_dim": 16, "norm_topk_prob": True, "mlp_only_layers": [1], **LAYERS_4},
        None,
    ),
    "qwen3_moe_sparse_step": (  # every second layer sparse, weights not renormalised
        "Qwen3MoeConfig",
        {**MOE, "head_dim": 16, "decoder_sparse_step": 2, "norm_topk_prob": False, **LAYERS_4},
        None,
    ),
    "qwen2_moe_shared": (  # a shared expert with its sigmoid gate
        "Qwen2MoeConfig",
        {**MOE, "shared_expert_intermediate_size": 48, "num_hidden_layers": 3},
        "60KB",
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, **LAYERS_3},
        None,
    ),
    "olmoe_clip_qkv": (  # q/k normalised over their whole width, then clipped
        "OlmoeConfig",
        {**MOE, "intermediate_size": 32, "clip_qkv": 1.5, "num_hidden_layers": 3},
        None,
    ),
    "gpt_oss": (  # sinks, sliding/full layers (window 6), biased router and experts, yarn
        "GptOssConfig",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "swiglu_limit": 0.3,  # low enough that the clamps bite on a random model
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        },
        None,
    ),
}
MOE_CHECKPOINTS = sorted(
    name for name in CHECKPOINTS if "moe" in name or name in ("mixtral", "gpt_oss")
)


def hf_config(name: str, **overrides):
    import transformers

    class_name, extra, _ = CHECKPOINTS[name]
    fields = {**_COMMON, "tie_word_embeddings": False, **extra, **overrides}
    return getattr(transformers, class_name)(**fields)


@torch.no_grad()
def random_hf_model(config, seed: int = 0):
    """An eager-attention transformers model whose every parameter (norms, biases too) is random."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    for param in model.parameters():
        param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def write_checkpoint(name: str, folder: Path, seed: int = 0) -> Path:
    """Saves checkpoint ``name`` as safetensors into ``folder`` and returns the folder."""
    model = random_hf_model(hf_config(name), seed)
    max_shard_size = CHECKPOINTS[name][2]
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@torch.no_grad()
def hf_logits(folder: Path, input_ids: list[int]) -> torch.Tensor:
    """Reference logits ``[T, vocab]`` from transformers loading ``folder`` (fp32, eager)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model(torch.tensor([input_ids])).logits[0].float()
