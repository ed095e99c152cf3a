"""The embedded default model (SmolLM2-135M-Instruct GGUF) converts, matches transformers, answers.

The conversion is cached in $RADIXLM_CACHE_DIR (set for the test session by tests/conftest.py).
Both sides use the gguf package's dequantization of the same file, so the weights are
bit-identical and only float32 summation order separates the logits.
"""

from __future__ import annotations

import pytest
import torch
from model_batches import KVSession, max_rel_err, run_logits

from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.models.default_model import default_gguf_path, resolve_model_path
from radixlm.srt.models.loader import load_model
from radixlm.srt.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # loads the default model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def folder(default_model_dir):
    return default_model_dir  # resolve_model_path(None), converted once per session


@pytest.fixture(scope="module")
def model(folder):
    return load_model(folder, torch.float32, "cpu")


@pytest.fixture(scope="module")
def prompt_ids(folder) -> list[int]:
    tokenizer = load_tokenizer(folder)
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "What is the capital of France?" in text
    return tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def transformers_gguf_model(folder):
    """transformers' own GGUF loading (its names, its q/k un-permutation, its dequantization)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import is_accelerate_available

    gguf = default_gguf_path()
    if is_accelerate_available():
        return AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
        )
    # What from_pretrained(gguf_file=...) does, minus its accelerate requirement. The model is
    # first built from our folder (quicker than random init); every parameter is then
    # overwritten by transformers' tensors (checked: nothing missing but the tied lm_head).
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf_model)
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert parsed["config"][key] == getattr(hf_model.config, key), key
    result = hf_model.load_state_dict(parsed["tensors"], strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    return hf_model.eval()


def test_default_is_smollm2(model):
    config = model.config
    assert (config.architecture, config.num_layers, config.hidden_size) == (
        "LlamaForCausalLM",
        30,
        576,
    )
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and 2 in config.eos_token_ids
    assert resolve_model_path(None) == model.config.model_dir  # cached: same folder, no work


def test_logits_match_transformers_loading_the_gguf(folder, model, prompt_ids):
    session = KVSession(model.config)
    ours = run_logits(model, session, ForwardMode.EXTEND, [(session.new_request(), prompt_ids)])
    with torch.no_grad():
        ref = transformers_gguf_model(folder)(torch.tensor([prompt_ids])).logits[0]
    assert max_rel_err(ours, ref) < 1e-4


def test_greedy_answer_names_paris(folder, model, prompt_ids):
    tokenizer = load_tokenizer(folder)
    session = KVSession(model.config)
    req = session.new_request()
    logits = run_logits(model, session, ForwardMode.EXTEND, [(req, prompt_ids)])[-1]
    out: list[int] = []
    for _ in range(12):  # "The capital of France is Paris." is 7 tokens
        out.append(int(logits.argmax()))
        answer = tokenizer.decode(out, skip_special_tokens=True)
        if out[-1] in model.config.eos_token_ids or "Paris" in answer:
            break
        logits = run_logits(model, session, ForwardMode.DECODE, [(req, [out[-1]])])[0]
    assert "Paris" in answer, answer
