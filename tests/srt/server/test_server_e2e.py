"""End to end: `radixlm serve` on the default model (SmolLM2-135M-Instruct) in a subprocess,
driven over HTTP with httpx and the official openai client: the session's shared default server
(``default_server``). SIGTERM's drain and exit without orphans are
tests/srt/server/process/test_supervision.py's."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import plain_http
import pytest

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

MAX_TOTAL_TOKENS = 8192  # the default server's pool (conftest.DEFAULT_SERVER_ARGS)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(default_server) -> ServerProcess:
    return default_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
        timeout=120,
    )


def generate(server: ServerProcess, body: dict) -> httpx.Response:
    return plain_http.post(server.url + "/generate", json=body, timeout=120)


def greedy(server: ServerProcess, text: str, n: int) -> dict:
    r = generate(server, {"text": text, "sampling_params": {"max_new_tokens": n, **GREEDY}})
    assert r.status_code == 200, r.text
    return r.json()


def kv_pool(server: ServerProcess) -> dict:
    return plain_http.get(server.url + "/server_info", timeout=30).json()["kv_pool"]


def stream_events(server: ServerProcess, path: str, body: dict) -> list:
    events = []
    with plain_http.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_native_generate(server: ServerProcess) -> None:
    out = greedy(server, "The capital of France is", 4)
    assert out["text"].startswith(" Paris")
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 4
    assert meta["prompt_tokens"] == 5
    again = greedy(server, "The capital of France is", 4)
    assert again["text"] == out["text"]
    assert again["meta_info"]["cached_tokens"] == 4  # all but the last prompt token


def test_chat_completion_answers_paris(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        max_tokens=9,
        temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_batch_input_ids_stream_and_logprobs(server: ServerProcess) -> None:
    texts = ["Once upon a time", "The sky is"]
    ids = plain_http.post(server.url + "/tokenize", json={"prompt": texts[0]}).json()["tokens"]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 3, **GREEDY},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    first = generate(server, body).json()
    meta = first["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == first["output_ids"]
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert chosen[0] <= 0 and top[0][1] == chosen[1]  # greedy picks the top token
        assert top[0][0] >= top[1][0] and isinstance(chosen[2], str)
    body = {"text": texts[1], "sampling_params": {"max_new_tokens": 3, **GREEDY}, "stream": True}
    events = stream_events(server, "/generate", body)
    assert events[-1] == "[DONE]"
    texts_so_far = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts_so_far, texts_so_far[1:], strict=False))
    second = events[-2]
    batch = generate(server, {"text": texts, "sampling_params": {"max_new_tokens": 3, **GREEDY}})
    assert [o["output_ids"] for o in batch.json()] == [first["output_ids"], second["output_ids"]]


def test_prefill_only_input_logprobs(server: ServerProcess) -> None:
    body = {
        "text": "Hello world, this is",
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = generate(server, body).json()
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None
    assert all(e[0] <= 0 for e in meta["input_token_logprobs"][1:])


def test_openai_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=3, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith("The capital of France is Paris")
    r = client.completions.create(
        model="default", prompt="1, 2, 3,", max_tokens=6, temperature=0, stop=[" 5"], logprobs=1
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and "5" not in choice.text
    assert len(choice.logprobs.tokens) == r.usage.completion_tokens
    kw = {
        "model": "default",
        "prompt": "My favourite colour is",
        "max_tokens": 3,
        "temperature": 1.0,
        "n": 2,
        "seed": 1234,
    }
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    prompt_ids = plain_http.post(
        str(client.base_url).replace("/v1/", "/tokenize"), json={"prompt": kw["prompt"]}
    ).json()["tokens"]
    assert a.usage.prompt_tokens == len(prompt_ids)  # counted once for the n choices
    if all(c.finish_reason == "length" for c in a.choices):
        assert a.usage.completion_tokens == 6
    assert 0 < a.usage.completion_tokens <= 6


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="default",
            max_tokens=4,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Say hi"}],
        )
    )
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_concurrent_mixed_requests_match_serial(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(4)]
    serial = [greedy(server, p, 3)["text"] for p in prompts]

    def one(k: int) -> str:
        p, kind = prompts[k % 4], (k // 4) % 3
        if kind == 0:
            return greedy(server, p, 3)["text"]
        if kind == 1:
            return (
                client.completions.create(model="default", prompt=p, max_tokens=3, temperature=0)
                .choices[0]
                .text
            )
        body = {"text": p, "sampling_params": {"max_new_tokens": 3, **GREEDY}, "stream": True}
        return stream_events(server, "/generate", body)[-2]["text"]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert results == [serial[k % 4] for k in range(64)]


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/generate", b"{oops", 400),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}, 400),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, 400),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, 400),
        ("/generate", {"text": "hello " * (MAX_TOTAL_TOKENS + 10)}, 400),
        (
            "/v1/chat/completions",
            {"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]},
            404,
        ),
        ("/v1/completions", {"model": "default", "prompt": "x", "top_p": 1.5}, 400),
        ("/v1/completions", {"model": "default", "prompt": "x", "n": "two"}, 400),
    ],
)
def test_bad_requests_get_4xx(server: ServerProcess, path: str, body: object, status: int) -> None:
    headers = {"content-type": "application/json"}
    kw = {"content": body, "headers": headers} if isinstance(body, bytes) else {"json": body}
    r = plain_http.post(server.url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert plain_http.get(server.url + "/health").status_code == 200


def test_server_healthy_after_errors(server: ServerProcess) -> None:
    assert plain_http.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert greedy(server, "The capital of France is", 2)["text"].startswith(" Paris")


def test_disconnect_mid_stream_frees_kv(server: ServerProcess) -> None:
    body = {
        "text": "Tell me a long story.",
        "rid": "walk-away",
        "stream": True,
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
    }
    with plain_http.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pool = kv_pool(server)
        if pool["num_running"] == 0 and pool["protected"] == 0:
            break
        time.sleep(0.2)
    assert pool["num_running"] == 0 and pool["num_waiting"] == 0 and pool["protected"] == 0
    assert pool["available"] + pool["evictable"] == MAX_TOTAL_TOKENS
    assert plain_http.post(server.url + "/flush_cache", timeout=30).status_code == 200
    assert kv_pool(server)["available"] == MAX_TOTAL_TOKENS


def test_metrics_histograms(server: ServerProcess) -> None:
    # a streamed request of its own (time to first token and between tokens are streams' figures)
    body = {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 3}}
    with plain_http.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    deadline = time.monotonic() + 5  # a request's figures are recorded as its answer goes out
    while True:
        text = plain_http.get(server.url + "/metrics", timeout=30).text
        counts = {
            ln.split("{")[0]: float(ln.split()[-1])
            for ln in text.splitlines()
            if ln.startswith("radixlm_") and "_count{" in ln
        }
        if counts["radixlm_e2e_request_latency_seconds_count"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counts["radixlm_e2e_request_latency_seconds_count"] > 0
    assert counts["radixlm_time_to_first_token_seconds_count"] > 0
    assert counts["radixlm_inter_token_latency_seconds_count"] > 0
    assert "radixlm_cache_hit_rate" in text and "radixlm_generation_tokens_total" in text
