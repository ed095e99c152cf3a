"""`radixlm serve --load-format dummy` on a folder holding only config.json and a tokenizer (the
benchmarks' random-weight models): the server, its tokenizer manager and detokenizer start
without weights and answer requests."""

from __future__ import annotations

import httpx
import pytest

from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder


@pytest.mark.slow
def test_config_only_folder_serves_random_weights(tmp_path, start_server) -> None:
    folder = make_model_folder(tmp_path / "config-only", TINY_LLAMA)
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
