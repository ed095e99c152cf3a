"""Writes tiny GGUF files the way llama.cpp's converter lays them out, from a transformers model.

For the llama architecture the rows of q and k are reordered (each head's two rope halves
interleaved), as llama.cpp does; 2-D weights are stored as float16 (the model's weights are
first rounded to float16 so nothing is lost), one as Q8_0, 1-D tensors as float32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
Q8_TENSOR = "blk.0.ffn_down.weight"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gguf_name(hf_name: str) -> str:
    base, kind = hf_name.rsplit(".", 1)
    if base in HF_TO_GGUF:
        return f"{HF_TO_GGUF[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{layer}.{HF_TO_GGUF[rest]}.{kind}"


def interleave_rope_halves(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, rows i and i + d/2 become neighbours."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@torch.no_grad()
def prepare_model(model) -> None:
    """Rounds 2-D weights to float16 and the Q8_0 tensor through Q8_0, so the GGUF is exact."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    for name, param in model.named_parameters():
        if param.dim() == 2:
            param.copy_(param.half().float())
        if gguf_name(name) == Q8_TENSOR:
            q8 = GGMLQuantizationType.Q8_0
            param.copy_(torch.from_numpy(dequantize(quantize(param.numpy(), q8), q8).copy()))


def write_gguf(model, arch: str, path: Path, rope_divisors: np.ndarray | None = None) -> Path:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    _add_hparams(writer, cfg)
    _add_tokenizer(writer, cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        _add_tensor(writer, gguf_name(name), tensor.numpy(), arch, cfg)
    if rope_divisors is not None:
        writer.add_tensor("rope_freqs.weight", rope_divisors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_hparams(writer, cfg) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def _add_tensor(writer, name: str, w: np.ndarray, arch: str, cfg) -> None:
    import gguf

    if arch == "llama" and ".attn_q." in name:
        w = interleave_rope_halves(w, cfg.num_attention_heads)
    elif arch == "llama" and ".attn_k." in name:
        w = interleave_rope_halves(w, cfg.num_key_value_heads)
    if name == Q8_TENSOR:
        q8 = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(w, q8), raw_dtype=q8)
    else:
        writer.add_tensor(name, w.astype(np.float16 if w.ndim == 2 else np.float32))


def byte_symbols() -> list[str]:
    """The byte-level BPE alphabet: one printable character per byte value."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _add_tokenizer(writer, vocab_size: int) -> None:
    symbols = byte_symbols()
    pairs = []
    for word in "the quick brown fox jumps over the lazy dog while hello world every mountain gives views".split():
        pairs += [(a, b) for a, b in zip(word[:-1], word[1:], strict=True) if (a, b) not in pairs]
    pairs = pairs[: vocab_size - len(SPECIAL_TOKENS) - len(symbols)]
    tokens = SPECIAL_TOKENS + symbols + [a + b for a, b in pairs]
    assert len(tokens) == vocab_size, len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
