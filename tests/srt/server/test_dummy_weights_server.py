"""`radixlm serve --load-format dummy` on a folder holding only config.json and a tokenizer (the
benchmarks' random-weight models): the server, its tokenizer manager and detokenizer start
without weights and answer requests."""

from __future__ import annotations

import httpx
import pytest

from radixlm.srt.bench.bench_gpu import make_model_folder

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


@pytest.mark.slow
def test_config_only_folder_serves_random_weights(tmp_path, start_server) -> None:
    folder = make_model_folder(tmp_path / "config-only", SHAPE)
    assert not list(folder.glob("*.safetensors"))
    server = start_server(
        "--model-path",
        folder,
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--max-total-tokens",
        "2048",
    )
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["completion_tokens"] == 4
