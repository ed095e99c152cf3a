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

    # SGLang's /get_weights_by_name reads the (random) running weights, POST and GET alike
    name = "model.layers.0.mlp.down_proj.weight"
    rows = httpx.post(f"{server.url}/get_weights_by_name", json={"name": name, "truncate_size": 2})
    assert rows.status_code == 200, rows.text
    values = rows.json()
    assert len(values) == 2 and len(values[0]) == TINY_LLAMA["intermediate_size"]
    query = {"name": name, "truncate_size": 2}
    assert httpx.get(f"{server.url}/get_weights_by_name", params=query).json() == values
    bad = httpx.post(f"{server.url}/get_weights_by_name", json={"name": "lm_head.bias"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
    bad = httpx.post(
        f"{server.url}/get_weights_by_name", json={"name": name, "truncate_size": 10**9}
    )
    assert bad.status_code == 200  # rows past the end: the whole tensor (SGLang's slicing)
    huge = httpx.post(
        f"{server.url}/get_weights_by_name",
        json={"name": "model.embed_tokens.weight", "truncate_size": -1},
    )
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "truncate_size"
