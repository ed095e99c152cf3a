"""Sessions and the full /generate field set over HTTP, on the fake worker (no model): what the
scheduler is sent for each turn, branching, offset, replace, errors, limits, aborts and that
nothing is left behind. The real-model checks (same greedy ids, cached history) are in
test_native_api_full.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fake_stack import FakeStack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeStack]:
    s = FakeStack(tmp_path_factory.mktemp("ipc"))
    yield s
    s.close()


def post(stack: FakeStack, path: str, body: object) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=30)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def open_session(stack: FakeStack, capacity: int = 200, **extra) -> str:
    r = post(stack, "/open_session", {"capacity_of_str_len": capacity, **extra})
    assert r.status_code == 200, r.text
    assert isinstance(r.json(), str)
    return r.json()


def turn(stack: FakeStack, sid: str, text: str, n: int = 3, **session) -> dict:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": n},
        "session_params": {"id": sid, **session},
        "return_prompt_token_ids": True,
    }
    r = post(stack, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def sent_ids(stack: FakeStack) -> list[int]:
    return list(list(stack.worker.received.values())[-1].input_ids)


def ids(stack: FakeStack, text: str) -> list[int]:
    return stack.tokenizer.encode(text, add_special_tokens=False)


def assert_clean(stack: FakeStack) -> None:
    deadline = time.monotonic() + 5
    while stack.tm.num_request_states and time.monotonic() < deadline:
        time.sleep(0.01)
    stack.tm.assert_no_requests()  # sessions' integrity too


def test_turns_send_the_history_then_the_new_tokens(stack: FakeStack) -> None:
    sid = open_session(stack)
    first = turn(stack, sid, "hello")
    h1 = ids(stack, "hello") + first["output_ids"]
    assert first["prompt_token_ids"] == ids(stack, "hello") == sent_ids(stack)
    second = turn(stack, sid, " more", rid=first["meta_info"]["id"])
    assert sent_ids(stack) == second["prompt_token_ids"] == h1 + ids(stack, " more")
    h2 = second["prompt_token_ids"] + second["output_ids"]
    third = turn(stack, sid, " again", rid=second["meta_info"]["id"])
    assert sent_ids(stack) == h2 + ids(stack, " again")
    branch = turn(stack, sid, " other", rid=first["meta_info"]["id"])  # from turn 1 again
    assert sent_ids(stack) == h1 + ids(stack, " other")
    cut = turn(stack, sid, " x", rid=third["meta_info"]["id"], offset=2)
    assert sent_ids(stack) == h1[:2] + ids(stack, " x")
    dropped = turn(stack, sid, " y", rid=second["meta_info"]["id"], drop_previous_output=True)
    assert sent_ids(stack) == second["prompt_token_ids"] + ids(stack, " y")
    fresh = turn(stack, sid, "new")  # no rid: a new branch, no history
    assert sent_ids(stack) == ids(stack, "new")
    rids = [t["meta_info"]["id"] for t in (first, second, third, branch, cut, dropped, fresh)]
    assert sorted(stack.tm.sessions.sessions[sid].turns) == sorted(rids)
    assert post(stack, "/close_session", {"session_id": sid}).status_code == 200
    assert sid not in stack.tm.sessions.sessions
    assert_clean(stack)


def test_client_rids_name_turns_and_replace_drops_the_branches_below(stack: FakeStack) -> None:
    sid = open_session(stack)
    short = {"sampling_params": {"max_new_tokens": 3}}
    body = {"text": "a", "rid": "t1", "session_params": {"id": sid}, **short}
    assert post(stack, "/generate", body).json()["meta_info"]["id"] == "t1"
    turn(stack, sid, "b", rid="t1")
    turn(stack, sid, "c", rid="t1")
    replace = {"id": sid, "rid": "t1", "replace": True}
    body = {"text": "d", "rid": "t4", "session_params": replace, **short}
    r = post(stack, "/generate", body)
    assert r.status_code == 200, r.text
    assert sorted(stack.tm.sessions.sessions[sid].turns) == ["t1", "t4"]
    again = {**body, "session_params": {"id": sid, "rid": "t1"}}
    assert error_of(post(stack, "/generate", again))["param"] == "rid"  # t4 names a turn
    assert post(stack, "/generate", {**body, "text": "e"}).status_code == 200  # replaces t4
    post(stack, "/close_session", {"session_id": sid})
    assert_clean(stack)


def test_streamed_turns_and_n_samples_join_the_session(stack: FakeStack) -> None:
    sid = open_session(stack)
    body = {"text": "s", "rid": "st", "stream": True, "session_params": {"id": sid}}
    body["sampling_params"] = {"max_new_tokens": 5}
    with httpx.stream("POST", stack.url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    turns = stack.tm.sessions.sessions[sid].turns
    assert not turns["st"].is_running and len(turns["st"].output_ids) > 0
    body = {"text": "k", "rid": "nn", "sampling_params": {"max_new_tokens": 2, "n": 2}}
    r = post(stack, "/generate", {**body, "session_params": {"id": sid, "rid": "st"}})
    assert r.status_code == 200, r.text
    assert {"nn_0", "nn_1"} <= set(turns)
    r = post(stack, "/generate", {**body, "session_params": {"id": sid, "replace": True}})
    assert "single request" in error_of(r)["message"]
    post(stack, "/close_session", {"session_id": sid})
    assert_clean(stack)


def test_session_errors_are_400s_naming_the_problem(stack: FakeStack) -> None:
    sid = open_session(stack, capacity=30)
    first = turn(stack, sid, "hello")
    gen = {"text": "x", "sampling_params": {"max_new_tokens": 3}}
    err = error_of(post(stack, "/generate", {**gen, "session_params": {"id": "nope"}}))
    assert "does not exist" in err["message"] and err["param"] == "session_params.id"
    err = error_of(post(stack, "/generate", {**gen, "session_params": {"id": sid, "rid": "zz"}}))
    assert err["param"] == "session_params.rid"
    bad = {"id": sid, "rid": first["meta_info"]["id"], "offset": 999}
    assert error_of(post(stack, "/generate", {**gen, "session_params": bad}))["param"].endswith(
        "offset"
    )
    big = {"text": "x", "sampling_params": {"max_new_tokens": 40}, "session_params": {"id": sid}}
    assert "capacity_of_str_len" in error_of(post(stack, "/generate", big))["message"]
    err = error_of(post(stack, "/generate", {**gen, "session_params": {"rid": "a"}}))
    assert err["param"] == "session_params.id"
    err = error_of(post(stack, "/generate", {**gen, "session_params": {"id": sid, "x": 1}}))
    assert err["param"] == "session_params.x"
    err = error_of(post(stack, "/generate", {**gen, "session_id": sid, "session_params": {}}))
    assert err["param"] == "session_id"
    assert post(stack, "/generate", {**gen, "session_params": {}}).status_code == 200  # no id
    assert error_of(post(stack, "/open_session", {"capacity_of_str_len": "9"}))["param"]
    assert error_of(post(stack, "/open_session", {}))["param"] == "capacity_of_str_len"
    err = error_of(post(stack, "/open_session", {"capacity_of_str_len": 9, "streaming": True}))
    assert err["code"] == "unsupported_parameter"
    err = error_of(post(stack, "/open_session", {"capacity_of_str_len": 9, "session_id": sid}))
    assert "already exists" in err["message"]
    assert post(stack, "/close_session", {"session_id": sid}).status_code == 200
    err = error_of(post(stack, "/close_session", {"session_id": sid}))
    assert "does not exist" in err["message"]
    err = error_of(post(stack, "/generate", {**gen, "session_params": {"id": sid}}))
    assert "does not exist" in err["message"]
    assert_clean(stack)


def test_session_limits(stack: FakeStack) -> None:
    sessions = stack.tm.sessions
    limits = sessions.max_sessions, sessions.max_turns
    sessions.max_sessions, sessions.max_turns = len(sessions.sessions) + 1, 2
    try:
        sid = open_session(stack)
        err = error_of(post(stack, "/open_session", {"capacity_of_str_len": 9}))
        assert "sessions are open" in err["message"]
        turn(stack, sid, "a")
        turn(stack, sid, "b")
        body = {"text": "c", "session_params": {"id": sid}}
        assert "more than the 2" in error_of(post(stack, "/generate", body))["message"]
        post(stack, "/close_session", {"session_id": sid})
        open_session(stack, session_id="again")  # a closed session frees its place
        post(stack, "/close_session", {"session_id": "again"})
    finally:
        sessions.max_sessions, sessions.max_turns = limits
    assert_clean(stack)


def test_an_aborted_turn_leaves_and_close_aborts_running_turns(stack: FakeStack) -> None:
    sid = open_session(stack, capacity=250)
    outs: dict[str, dict] = {}

    def run(rid: str) -> None:
        body = {"text": "x", "rid": rid, "sampling_params": {"max_new_tokens": 200}}
        outs[rid] = post(stack, "/generate", {**body, "session_params": {"id": sid}}).json()

    threads = [threading.Thread(target=run, args=(rid,)) for rid in ("long1", "long2")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(stack.tm.sessions.sessions[sid].turns) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert post(stack, "/abort_request", {"rid": "long1"}).status_code == 200
    threads[0].join(10)
    assert outs["long1"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "long1" not in stack.tm.sessions.sessions[sid].turns
    body = {"text": "y", "session_params": {"id": sid, "rid": "long1"}}
    assert error_of(post(stack, "/generate", body))["param"] == "session_params.rid"
    post(stack, "/close_session", {"session_id": sid})
    threads[1].join(10)
    assert outs["long2"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert_clean(stack)
    assert stack.tm.sessions.num_stored_tokens == 0


def test_generate_fields_implemented_accepted_or_refused(stack: FakeStack) -> None:
    base = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    accepted = {
        "data_parallel_rank": 0,
        "routed_dp_rank": None,
        "log_metrics": True,
        "no_logs": True,
        "custom_labels": {"team": "a"},
        "routing_key": "k",
        "conversation_id": "c",
        "kv_router_hint": {"block_hashes": []},
        "external_trace_header": {"traceparent": "x"},
        "received_time": 12.5,
        "session_id": "label",
        "return_logprob": None,
        "logprob_start_len": None,
        "top_logprobs_num": None,
        "lora_path": None,
        "return_hidden_states": False,
        "token_ids_logprob": [],
        "cache_salt": "",
        "routed_experts_start_len": 0,
        # fields SGLang 0.5.23 added, at their off values (kv_hints: a routing hint)
        "watermark": None,
        "sampling_logprobs_mode": "selected",
        "return_flat_raw_output_top_logprobs": False,
        "mm_processor_kwargs": None,
        "token_indices_to_pool": None,
        "kv_hints": {"prefix_hashes": []},
    }
    assert post(stack, "/generate", {**base, **accepted}).status_code == 200
    batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}}
    assert post(stack, "/generate", {**batch, "lora_path": [None, None]}).status_code == 200
    for field, value, code in [
        ("data_parallel_rank", 1, None),
        ("routed_dp_rank", 2, None),
        ("token_ids_logprob", [10**6], None),  # implemented: ids of the vocabulary only
        ("return_hidden_states", True, "unsupported_parameter"),
        ("cache_salt", "t" * 257, None),  # implemented: bounded
        ("cache_salt", ["a", "b", "c"], None),  # one per prompt, not more
        ("lora_path", ["a", None], "unsupported_parameter"),
        ("return_entropy", True, "unsupported_parameter"),
        ("bootstrap_room", 3, "unsupported_parameter"),
        ("sampling_param", {}, None),  # a typo is not silently ignored
        ("watermark", {"gamma": 0.25}, "unsupported_parameter"),
        ("sampling_logprobs_mode", "support", "unsupported_parameter"),
        ("token_indices_to_pool", [0, 1], "unsupported_parameter"),
    ]:
        err = error_of(post(stack, "/generate", {**base, field: value}))
        assert err["param"] == field, (field, err)
        if code is not None:
            assert err["code"] == code, (field, err)


def test_log_metrics_false_keeps_a_request_out_of_the_metrics(stack: FakeStack) -> None:
    def finished() -> float:
        return stack.metrics.requests._value.get()

    before = finished()
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert post(stack, "/generate", {**body, "log_metrics": False}).status_code == 200
    assert finished() == before
    assert post(stack, "/generate", body).status_code == 200
    assert finished() == before + 1


def test_the_body_a_router_forwards_is_accepted(stack: FakeStack) -> None:
    """What sglang-router 0.3.2 sends for ``/generate`` (its typed request re-serialized: a
    null ``model`` and the defaults of the fields it knows), and ``model`` naming a model."""
    forwarded = {
        "text": "hi",
        "model": None,
        "sampling_params": {"max_new_tokens": 2},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "rid": "routed",
        "data_parallel_rank": 0,  # what its dp-aware mode adds
    }
    assert post(stack, "/generate", forwarded).status_code == 200
    for name in ("fake-model", "default", "/models/fake-model"):
        assert post(stack, "/generate", {**forwarded, "model": name}).status_code == 200
    err = error_of(post(stack, "/generate", {**forwarded, "model": "gpt-x"}), 404)
    assert err["code"] == "model_not_found" and "/models/" not in err["message"]
