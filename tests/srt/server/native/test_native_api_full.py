"""End to end on the default model: sessions reproduce exactly the requests that send the whole
history as input_ids (same greedy ids), the history is served from the radix cache, branches
and offsets, the session errors, and that the server is idle and leak-free afterwards."""

from __future__ import annotations

import time

import httpx
import plain_http
import pytest

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def server(default_server) -> ServerProcess:
    return default_server


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return plain_http.post(server.url + path, json=body, timeout=120)


def ok(r: httpx.Response):
    assert r.status_code == 200, r.text
    return r.json()


def tokens(server: ServerProcess, text: str, special: bool) -> list[int]:
    return ok(post(server, "/tokenize", {"prompt": text, "add_special_tokens": special}))["tokens"]


def session_turn(server: ServerProcess, sid: str, text: str, **params) -> dict:
    body = {
        "text": text,
        "sampling_params": GREEDY,
        "session_params": {"id": sid, **params},
        "return_prompt_token_ids": True,
    }
    return ok(post(server, "/generate", body))


def whole_history(server: ServerProcess, input_ids: list[int]) -> dict:
    body = {"input_ids": input_ids, "sampling_params": GREEDY, "return_prompt_token_ids": True}
    return ok(post(server, "/generate", body))


def wait_idle(server: ServerProcess) -> dict:
    deadline = time.monotonic() + 30
    while True:
        info = ok(plain_http.get(server.url + "/server_info", timeout=30))
        if info["num_request_states"] == 0 and info["kv_pool"]["num_running"] == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def assert_no_leak(server: ServerProcess) -> None:
    info = wait_idle(server)
    kv = info["kv_pool"]
    assert kv["available"] + kv["evictable"] + kv["protected"] == kv["max_total_tokens"]
    assert kv["protected"] == 0 and kv["num_waiting"] == 0


def test_session_turns_equal_whole_history_requests(server: ServerProcess) -> None:
    sid = ok(post(server, "/open_session", {"capacity_of_str_len": 1024}))
    prompt = "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n"
    t1 = session_turn(server, sid, prompt)
    assert t1["prompt_token_ids"] == tokens(server, prompt, True)
    history = t1["prompt_token_ids"] + t1["output_ids"]
    follow = "<|im_end|>\n<|im_start|>user\nAnd a color?<|im_end|>\n<|im_start|>assistant\n"
    t2 = session_turn(server, sid, follow, rid=t1["meta_info"]["id"])
    assert t2["prompt_token_ids"] == history + tokens(server, follow, False)
    # the whole first turn (all but its last output token, whose KV is never computed) is
    # served from the cache
    assert t2["meta_info"]["cached_tokens"] >= len(history) - 1
    assert t2["meta_info"]["prompt_tokens"] == len(t2["prompt_token_ids"])
    ref = whole_history(server, t2["prompt_token_ids"])
    assert ref["output_ids"] == t2["output_ids"] and ref["text"] == t2["text"]

    t3 = session_turn(server, sid, " More.", rid=t2["meta_info"]["id"])
    h2 = t2["prompt_token_ids"] + t2["output_ids"]
    assert t3["prompt_token_ids"] == h2 + tokens(server, " More.", False)
    assert t3["meta_info"]["cached_tokens"] >= len(h2) - 1
    assert whole_history(server, t3["prompt_token_ids"])["output_ids"] == t3["output_ids"]

    cut = len(t1["prompt_token_ids"]) + 2  # a branch from turn 3 that keeps little of it
    branch = session_turn(server, sid, " Why?", rid=t3["meta_info"]["id"], offset=cut)
    assert branch["prompt_token_ids"] == history[:cut] + tokens(server, " Why?", False)
    assert whole_history(server, branch["prompt_token_ids"])["output_ids"] == branch["output_ids"]
    closed = post(server, "/close_session", {"session_id": sid})
    assert closed.status_code == 200 and closed.content == b""  # SGLang's empty 200
    assert_no_leak(server)
    info = ok(plain_http.get(server.url + "/server_info", timeout=30))
    assert info["sessions"]["num_open_sessions"] == 0
    assert info["sessions"]["num_session_tokens"] == 0


def test_session_errors_and_limits_over_the_real_server(server: ServerProcess) -> None:
    sid = ok(post(server, "/open_session", {"capacity_of_str_len": 40, "session_id": "e2e"}))
    assert sid == "e2e"
    gen = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    t1 = ok(post(server, "/generate", {**gen, "session_params": {"id": sid}}))
    r = post(server, "/generate", {**gen, "session_params": {"id": "missing"}})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    big = {**gen, "sampling_params": {"max_new_tokens": 64}}
    r = post(
        server, "/generate", {**big, "session_params": {"id": sid, "rid": t1["meta_info"]["id"]}}
    )
    assert r.status_code == 400 and "capacity_of_str_len" in r.json()["error"]["message"]
    # max_new_tokens null: up to what the session's capacity leaves (not the whole context)
    rest = {"text": "Hi", "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}
    t2 = ok(post(server, "/generate", {**rest, "session_params": {"id": sid}}))
    meta = t2["meta_info"]
    assert meta["prompt_tokens"] + meta["completion_tokens"] == 40
    # SGLang: a priority is ignored without --enable-priority-scheduling; a non-integer is a 400
    assert post(server, "/generate", {**gen, "priority": 3}).status_code == 200
    assert post(server, "/generate", {**gen, "priority": "high"}).status_code == 400
    assert post(server, "/generate", {**gen, "data_parallel_rank": 0}).status_code == 200
    assert post(server, "/close_session", {"session_id": sid}).status_code == 200
    assert post(server, "/close_session", {"session_id": sid}).status_code == 400
    assert_no_leak(server)
