"""What an SGLang router (sgl-model-gateway / sglang-router) reads from a worker, checked over a
real server with an API key: /health without the key; /server_info and /model_info (and their
get_ aliases) with the fields and types the router deserializes; /get_load (per rank:
``dp_rank``, ``num_tokens``, ``num_waiting_reqs``) and /v1/loads?include=core (``loads[]`` and
``aggregate.total_tokens``) at rest and under load; POST /flush_cache; /v1/models; the
``data_parallel_rank`` its dp-aware mode adds. sglang-router 0.3.2 itself was run in front of
this server by hand (registration, load, generate, chat, flush all succeed); it is not a test
dependency."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import plain_http
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOTAL_TOKENS = 4096
MAX_RUNNING = 2
CORE_KEYS = {
    "dp_rank",
    "timestamp",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_total_reqs",
    "num_used_tokens",
    "num_total_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
}


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server(
        "--max-total-tokens",
        MAX_TOTAL_TOKENS,
        "--max-running-requests",
        MAX_RUNNING,
        "--api-key",
        KEY,
    )


def get(server: ServerProcess, path: str, **kw) -> httpx.Response:
    return plain_http.get(server.url + path, headers=AUTH, timeout=60, **kw)


def ok_json(r: httpx.Response):
    assert r.status_code == 200, r.text
    return r.json()


def long_request(server: ServerProcess, seed: int, n: int = 32) -> httpx.Response:
    body = {
        "text": f"Count from {seed}:",
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    return plain_http.post(server.url + "/generate", json=body, headers=AUTH, timeout=300)


def test_health_answers_without_the_key(server: ServerProcess) -> None:
    assert plain_http.get(server.url + "/health", timeout=10).status_code == 200
    assert plain_http.get(server.url + "/server_info", timeout=10).status_code == 401


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_has_the_fields_a_router_reads(server: ServerProcess, path: str) -> None:
    info = ok_json(get(server, path))
    assert isinstance(info["model_path"], str) and info["model_path"]
    assert info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert info["dp_size"] == 1 and info["tp_size"] == 1
    assert isinstance(info["version"], str)
    assert info["max_total_tokens"] == info["max_total_num_tokens"] == MAX_TOTAL_TOKENS
    assert info["max_running_requests"] == MAX_RUNNING
    for name in ("max_prefill_tokens", "page_size", "context_length", "max_req_input_len"):
        assert type(info[name]) is int and info[name] > 0, name
    for optional in ("model_id", "model", "max_batch_size", "max_num_reqs"):
        assert optional not in info or isinstance(info[optional], (str, int)), optional
    assert isinstance(info["internal_states"], list) and len(info["internal_states"]) == 1
    assert KEY not in str(info) and "api_key" not in info


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_has_the_fields_a_router_reads(server: ServerProcess, path: str) -> None:
    info = ok_json(get(server, path))
    assert isinstance(info["model_path"], str)
    assert info["tokenizer_path"] is None or isinstance(info["tokenizer_path"], str)
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert "model_type" not in info or isinstance(info["model_type"], str)


def test_models_list_the_served_name(server: ServerProcess) -> None:
    data = ok_json(get(server, "/v1/models"))["data"]
    assert [m["id"] for m in data] == ["SmolLM2-135M-Instruct"]


def test_tokenizer_info(server: ServerProcess) -> None:
    info = ok_json(get(server, "/tokenizer_info"))
    assert info["vocab_size"] == 49152 and info["model_max_length"] > 0
    assert isinstance(info["chat_template"], str) and info["eos_token_id"] is not None


def test_loads_at_rest(server: ServerProcess) -> None:
    (entry,) = ok_json(get(server, "/get_load"))
    assert entry["dp_rank"] == 0 and entry["num_reqs"] == entry["num_waiting_reqs"] == 0
    assert type(entry["num_tokens"]) is int and entry["num_pending_tokens"] == 0
    body = ok_json(get(server, "/v1/loads", params={"include": "core"}))
    assert body["dp_rank_count"] == 1 and isinstance(body["timestamp"], str)
    (load,) = body["loads"]
    assert set(load) == CORE_KEYS
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0
    assert load["max_total_num_tokens"] == MAX_TOTAL_TOKENS
    assert 0.0 <= load["token_usage"] <= 1.0
    assert body["aggregate"]["total_tokens"] == load["num_total_tokens"] == entry["num_tokens"]
    assert set(ok_json(get(server, "/v1/loads"))["loads"][0]) == CORE_KEYS | {"queues"}
    assert ok_json(get(server, "/v1/loads", params={"dp_rank": 1}))["loads"] == []
    r = get(server, "/v1/loads", params={"include": "core,bogus"})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    assert get(server, "/v1/loads", params={"format": "xml"}).status_code == 400
    assert get(server, "/v1/loads", params={"dp_rank": "x"}).status_code == 400
    text = get(server, "/v1/loads", params={"format": "prometheus"}).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["radixlm_num_running_reqs"].labels == {"dp_rank": "0"}
    assert samples["radixlm_max_total_num_tokens"].value == MAX_TOTAL_TOKENS


def test_loads_follow_running_and_waiting_requests(server: ServerProcess) -> None:
    """More long requests than the server runs at once: the load shows them running and
    waiting, with their tokens, while load queries keep answering within a few steps (the
    scheduler answers between two steps; the bound follows this machine's step time); then it
    drains."""
    first = long_request(server, 0).json()
    alone = first["output_ids"]
    step_s = first["meta_info"]["e2e_latency"] / len(alone)
    # half as long under load: two waves of them still run while the loads are polled
    n = len(alone) // 2
    with concurrent.futures.ThreadPoolExecutor(MAX_RUNNING + 2) as pool:
        futures = [pool.submit(long_request, server, 0, n)]
        futures += [pool.submit(long_request, server, i, n) for i in range(1, MAX_RUNNING + 2)]
        seen_running = seen_waiting = seen_throughput = 0
        latencies = []
        deadline = time.monotonic() + 240
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            t0, wall0 = time.monotonic(), time.time()
            load = ok_json(get(server, "/v1/loads", params={"include": "core,queues"}))["loads"][0]
            latencies.append(time.monotonic() - t0)
            assert wall0 - 1 <= load["timestamp"] <= time.time() + 1  # measured when asked
            (legacy,) = ok_json(get(server, "/get_load"))
            assert load["num_running_reqs"] <= MAX_RUNNING
            assert load["num_total_tokens"] >= load["num_used_tokens"]
            assert legacy["num_tokens"] >= legacy["num_pending_tokens"]
            if load["num_running_reqs"]:
                seen_running += 1
                assert load["num_used_tokens"] > 0 and load["token_usage"] > 0
            if load["num_waiting_reqs"]:
                seen_waiting += 1
                assert load["queues"]["waiting"] >= 1
                assert load["num_total_tokens"] > load["num_used_tokens"]  # the waiting prompts
            seen_throughput += load["gen_throughput"] > 0
            time.sleep(0.05)
        outs = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in outs)
    assert outs[0].json()["output_ids"] == alone[:n]  # polling changes nothing generated
    assert seen_running and seen_waiting and seen_throughput
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.5 + 4 * step_s, (latencies, step_s)
    load = ok_json(get(server, "/v1/loads"))["loads"][0]
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0
    assert load["num_used_tokens"] == 0


def test_many_concurrent_load_queries_are_answered(server: ServerProcess) -> None:
    results: list[int] = []

    def ask() -> None:
        results.append(get(server, "/v1/loads", params={"include": "core"}).status_code)

    threads = [threading.Thread(target=ask) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200] * 40


def test_flush_cache_and_dp_rank_as_a_router_sends_them(server: ServerProcess) -> None:
    assert plain_http.post(server.url + "/flush_cache", headers=AUTH, timeout=60).status_code == 200
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "model": None}
    r = plain_http.post(
        server.url + "/generate", json={**body, "data_parallel_rank": 0}, headers=AUTH, timeout=60
    )
    assert r.status_code == 200, r.text
    r = plain_http.post(
        server.url + "/generate", json={**body, "data_parallel_rank": 1}, headers=AUTH, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_rank"
