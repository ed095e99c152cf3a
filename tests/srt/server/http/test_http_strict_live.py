"""The hostile-client findings against a real `radixlm serve` (a tiny random Llama with SmolLM2's
tokenizer, so it starts fast): each reproduction is a 4xx now, and every test ends with /health
200, no request state in the tokenizer manager and the idle KV pool adding up."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import plain_http
import pytest

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

ADMIN = "live-admin-key"
POOL = 2048
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, start_server) -> ServerProcess:
    return start_server(
        "--model-path",
        tiny_llama_dir,
        "--max-total-tokens",
        POOL,
        "--admin-api-key",
        ADMIN,
        "--max-request-body-mb",
        64,
        "--default-max-tokens",
        24,
    )


def info(server: ServerProcess) -> dict:
    """/get_server_info as the admin sees it (local paths included)."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    return plain_http.get(server.url + "/get_server_info", headers=admin, timeout=30).json()


@pytest.fixture(autouse=True)
def clean(server: ServerProcess) -> Iterator[None]:
    yield
    assert plain_http.get(server.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    state = info(server)
    while (state["num_request_states"] or state["kv_pool"]["num_running"]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
        state = info(server)
    assert state["num_request_states"] == 0, state["num_request_states"]
    pool = state["kv_pool"]
    assert pool["available"] + pool["evictable"] + pool["protected"] == pool["max_total_tokens"]


def post(server: ServerProcess, path: str, body: object, **kw) -> httpx.Response:
    return plain_http.post(server.url + path, json=body, timeout=120, **kw)


def test_seed_top_of_range_with_n_2(server: ServerProcess) -> None:
    r = post(
        server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2**64 - 1}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


@pytest.mark.parametrize("bad", [-1, 2**40])
def test_prompt_token_ids_out_of_range(server: ServerProcess, bad: int) -> None:
    r = post(server, "/v1/completions", {"prompt": [1, bad], "max_tokens": 2, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_cross_origin_shapes_and_coercions(server: ServerProcess) -> None:
    raw = orjson.dumps({"abort_all": True})
    r = plain_http.post(
        server.url + "/abort_request",
        content=raw,
        timeout=10,
        headers={"Content-Type": "text/plain"},
    )
    assert r.status_code == 415 and "text/plain" in r.json()["error"]["message"]
    r = post(server, "/abort_request", {"abort_all": True})
    assert r.status_code == 401  # the admin key is set
    assert post(server, "/flush_cache", {}).status_code == 401
    assert plain_http.get(server.url + "/flush_cache", timeout=10).status_code == 405
    ok = {"Authorization": f"Bearer {ADMIN}"}
    assert post(server, "/flush_cache", {}, headers=ok).status_code == 200
    for field in ({"max_tokens": "10"}, {"stream": "yes"}):
        r = post(server, "/v1/completions", {"prompt": "hi", **field})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(field))


def test_50mb_prompt_is_refused_quickly_and_health_stays_up(server: ServerProcess) -> None:
    raw = orjson.dumps({"text": "hello world " * 4_400_000})
    gaps: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            plain_http.get(server.url + "/health", timeout=30)
            gaps.append(time.monotonic() - t0)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        t0 = time.monotonic()
        r = plain_http.post(
            server.url + "/generate",
            content=raw,
            timeout=120,
            headers={"Content-Type": "application/json"},
        )
        elapsed = time.monotonic() - t0
    finally:
        done.set()
        poller.join()
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert elapsed < 10 and max(gaps, default=0) < 2.0, (elapsed, max(gaps, default=0))


def test_n_is_capped(server: ServerProcess) -> None:
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 10000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert time.monotonic() - t0 < 5


def test_chat_defaults_and_shapes(server: ServerProcess) -> None:
    r = post(server, "/v1/chat/completions", {**CHAT, "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 24  # --default-max-tokens, not the whole context
    assert out["choices"][0]["message"]["refusal"] is None
    r = post(server, "/v1/chat/completions", {**CHAT, "model": "nope", "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found"
    assert info(server)["model_path"] not in err["message"], err  # no local path


def test_scheduler_rejection_and_disconnect_leave_no_state(server: ServerProcess) -> None:
    r = post(server, "/generate", {"text": "hi", "sampling_params": {"regex": "(", "n": 2}})
    assert 400 <= r.status_code < 500, r.text
    with plain_http.stream(
        "POST",
        server.url + "/generate",
        timeout=60,
        json={
            "text": "hi",
            "stream": True,
            "rid": "gone",
            "sampling_params": {"max_new_tokens": 500, "ignore_eos": True, "n": 3},
        },
    ) as resp:
        next(resp.iter_lines())
