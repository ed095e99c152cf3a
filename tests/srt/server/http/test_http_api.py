"""The HTTP layer over a fake worker (no model): native and OpenAI shapes, streaming, errors,
disconnects, API key, metrics. The real-model end-to-end tests are in test_server_e2e.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from fake_stack import CONTEXT_LENGTH, FakeStack

TOKEN = "sk-test-key"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeStack]:
    s = FakeStack(tmp_path_factory.mktemp("ipc"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(stack: FakeStack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.url + "/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    )


def post(stack: FakeStack, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=30, **kw)


def expected_text(stack: FakeStack, n: int) -> str:
    return stack.tokenizer.decode(stack.worker.expected_ids(n))


def last_received(stack: FakeStack):
    """The last request the worker got (wire rids are internal uuids, not the client's)."""
    return list(stack.worker.received.values())[-1]


def sse_events(lines: Iterator[str]) -> list[object]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---------------------------------------------------------------------- native API
def test_generate_text(stack: FakeStack) -> None:
    r = post(stack, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 6}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == expected_text(stack, 6)
    assert out["output_ids"] == stack.worker.expected_ids(6)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] == len(stack.tokenizer.encode("hi"))
    assert "input_token_logprobs" not in meta


def test_generate_batch_input_ids_and_n(stack: FakeStack) -> None:
    r = post(
        stack,
        "/generate",
        {
            "input_ids": [[5, 6, 7], [8, 9]],
            "sampling_params": {"max_new_tokens": 3, "top_k": -1, "temperature": None},
        },
    )
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 2]
    r = post(
        stack,
        "/generate",
        {"text": "x", "rid": "many", "sampling_params": {"max_new_tokens": 2, "n": 3}},
    )
    assert sorted(o["meta_info"]["id"] for o in r.json()) == ["many_0", "many_1", "many_2"]


def test_generate_stream_is_cumulative_and_utf8_safe(stack: FakeStack) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 12}, "stream": True}
    with httpx.stream("POST", stack.url + "/generate", json=body, timeout=30) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert len(texts) > 3
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert all("\ufffd" not in t for t in texts[:-1])  # the last may end inside a character
    assert texts[-1] == expected_text(stack, 12)
    assert [e["meta_info"]["finish_reason"] is not None for e in events[:-1]].count(True) == 1


def test_generate_logprobs(stack: FakeStack) -> None:
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 2},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = post(stack, "/generate", body).json()["meta_info"]
    first = stack.worker.expected_ids(1)[0]
    assert meta["output_token_logprobs"][0] == pytest.approx(
        [-0.1, first, stack.tokenizer.decode([first])]
    )
    assert meta["input_token_logprobs"][0][:2] == [None, 3]
    assert len(meta["input_token_logprobs"]) == 3
    assert len(meta["output_top_logprobs"][1]) == 2


def test_prefill_only_and_stop_string(stack: FakeStack) -> None:
    out = post(stack, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}).json()
    assert out["text"] == "" and out["meta_info"]["completion_tokens"] == 0
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 20, "stop": "world"}}
    out = post(stack, "/generate", body).json()
    assert out["text"] == "Hello "
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "world"}
    body["sampling_params"]["no_stop_trim"] = True
    assert post(stack, "/generate", body).json()["text"] == "Hello world"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": "hi", "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"text": "hi", "input_ids": [1]}, "exactly one"),
        ({"text": "hi " * CONTEXT_LENGTH}, "shorten the prompt"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": CONTEXT_LENGTH}}, "context length"),
        ({"input_ids": [10**9]}, "input_ids"),
        ({"text": 5}, "text"),
        ({"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ],
)
def test_generate_rejects_bad_requests(stack: FakeStack, body: dict, needle: str) -> None:
    r = post(stack, "/generate", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_malformed_json_then_healthy(stack: FakeStack) -> None:
    for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
        r = httpx.post(
            stack.url + path,
            content=b"{not json",
            timeout=10,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.get(stack.url + "/health").status_code == 200


def test_tokenize_detokenize_and_info(stack: FakeStack) -> None:
    toks = post(stack, "/tokenize", {"prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) and toks["max_model_len"] == CONTEXT_LENGTH
    detok = post(stack, "/detokenize", {"tokens": toks["tokens"]}).json()
    assert detok == {"text": "Hello world", "prompt": "Hello world"}  # SGLang's and vLLM's key
    info = httpx.get(stack.url + "/get_model_info").json()
    assert info["model_path"] == "/models/fake-model" and info["is_generation"] is True
    assert httpx.get(stack.url + "/model_info").json() == info
    server = httpx.get(stack.url + "/server_info").json()
    assert server["kv_pool"]["max_total_tokens"] == 1024
    assert "api_key" not in server


def test_flush_cache_refused_while_busy(stack: FakeStack) -> None:
    assert post(stack, "/flush_cache", {}).status_code == 200
    stack.worker.tick_s = 0.05
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 40}, "stream": True}
    try:
        with httpx.stream("POST", stack.url + "/generate", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            busy = post(stack, "/flush_cache", {})
    finally:
        stack.worker.tick_s = 0.005
    assert busy.status_code == 400 and "retry when idle" in busy.json()["error"]["message"]


def test_abort_request_by_rid(stack: FakeStack) -> None:
    stack.worker.tick_s = 0.05
    body = {
        "text": "hi",
        "rid": "to-abort",
        "sampling_params": {"max_new_tokens": 100},
        "stream": True,
    }
    try:
        with httpx.stream("POST", stack.url + "/generate", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            assert post(stack, "/abort_request", {"rid": "to-abo"}).json()["num_aborted"] == 0
            assert post(stack, "/abort_request", {"rid": "to-abort"}).status_code == 200
            events = sse_events(lines)
    finally:
        stack.worker.tick_s = 0.005
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(stack, "/abort_request", {}).status_code == 400


def test_client_disconnect_aborts(stack: FakeStack) -> None:
    stack.worker.tick_s = 0.05
    body = {
        "text": "hi",
        "rid": "gone-away",
        "sampling_params": {"max_new_tokens": 200},
        "stream": True,
    }
    try:
        with httpx.stream("POST", stack.url + "/generate", json=body, timeout=30) as r:
            next(r.iter_lines())  # then the connection closes mid-stream
        wire_rid = last_received(stack).rid
        deadline = time.monotonic() + 3
        while wire_rid in stack.worker.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert wire_rid not in stack.worker.active
        assert any(a.rid == wire_rid for a in stack.worker.aborts)
        stack.tm.assert_no_requests()
    finally:
        stack.worker.tick_s = 0.005


def test_non_streaming_disconnect_aborts(stack: FakeStack) -> None:
    stack.worker.tick_s = 0.05
    body = {"text": "hi", "rid": "impatient", "sampling_params": {"max_new_tokens": 200}}
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(stack.url + "/generate", json=body, timeout=0.5)
        wire_rid = last_received(stack).rid
        deadline = time.monotonic() + 3
        while wire_rid in stack.worker.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert wire_rid not in stack.worker.active
    finally:
        stack.worker.tick_s = 0.005


# ---------------------------------------------------------------------- OpenAI API
def test_models(stack: FakeStack, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"


def test_chat_completion(stack: FakeStack, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(r.choices) == 2 and r.object == "chat.completion"
    assert all(c.message.content == expected_text(stack, 5) for c in r.choices)
    assert all(c.finish_reason == "length" for c in r.choices)
    assert len(r.choices[0].logprobs.content) == 5
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    prompt_ids = stack.tokenizer.encode("<|user|>hi\n<|assistant|>", add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 10 and r.usage.total_tokens == 10 + len(prompt_ids)
    sent = [stack.worker.received[rid] for rid in stack.worker.received]
    assert sent[-1].input_ids == prompt_ids


def test_chat_stop_and_extra_body(stack: FakeStack, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        stop=["world"],
        max_completion_tokens=20,
        seed=7,
        temperature=0.5,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "regex": "[a-z]+",
            "ignore_eos": True,
            "repetition_penalty": 1.1,
            "rid": "xb",
        },
    )
    assert r.choices[0].message.content == "Hello " and r.choices[0].finish_reason == "stop"
    sp = last_received(stack).sampling_params
    assert (sp["top_k"], sp["min_p"], sp["regex"], sp["ignore_eos"]) == (5, 0.1, "[a-z]+", True)
    assert (sp["seed"], sp["temperature"], sp["max_new_tokens"]) == (7, 0.5, 20)


def test_response_format_maps_to_json_schema(stack: FakeStack, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        extra_body={"rid": "rf"},
    )
    assert json.loads(last_received(stack).sampling_params["json_schema"]) == schema
    client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        response_format={"type": "json_object"},
        extra_body={"rid": "jo"},
    )
    assert json.loads(last_received(stack).sampling_params["json_schema"]) == {"type": "object"}


def test_chat_stream_with_usage(stack: FakeStack, client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finishes = ["", ""], [0, 0]
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] += choice.finish_reason is not None
    assert texts == [expected_text(stack, 8)] * 2 and finishes == [1, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_prompts_echo_logprobs(stack: FakeStack, client: openai.OpenAI) -> None:
    r = client.completions.create(model="default", prompt=["a", "b"], max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 12
    ids = stack.tokenizer.encode("Hello")
    r = client.completions.create(model="default", prompt=ids, max_tokens=2, echo=True)
    assert r.choices[0].text == "Hello" + expected_text(stack, 2)
    r = client.completions.create(model="default", prompt="Hello", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [stack.tokenizer.decode([t]) for t in stack.worker.expected_ids(3)]
    assert lp.token_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert lp.text_offset[0] == len("Hello") and len(lp.top_logprobs[0]) == 2


def test_completions_echo_with_prompt_logprobs_raw(stack: FakeStack) -> None:
    """The first prompt token has no logprob: null, as OpenAI sends it (the openai client's
    strict validation rejects that null, hence raw HTTP here)."""
    ids = stack.tokenizer.encode("Hello world")
    body = {"model": "default", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0}
    lp = post(stack, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    sampled = zip(lp["tokens"][1:], lp["token_logprobs"][1:], strict=True)
    assert lp["top_logprobs"][1:] == [{t: v} for t, v in sampled]  # logprobs 0 (vLLM's shape)
    assert lp["tokens"][: len(ids)] == [stack.tokenizer.decode([t]) for t in ids]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["text_offset"][0] == 0


def test_completions_stream(stack: FakeStack) -> None:
    # openai's Completion type has no null finish_reason, which every non-final streamed
    # chunk carries (as OpenAI's own), so this stream is read without strict validation
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.completions.create(
            model="default",
            prompt="x",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(stack, 6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/completions",
            {"model": "default", "prompt": "x", "temperature": "hot"},
            "temperature",
        ),
        ("/v1/completions", {"model": "default", "prompt": "x", "logprobs": 9}, "logprobs"),
        ("/v1/completions", {"model": "default", "prompt": []}, "prompt"),
        ("/v1/completions", {"model": "default"}, "prompt"),
        ("/v1/chat/completions", {"model": "default", "messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "x", "content": ""}]},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": "default", "n": 0, "messages": [{"role": "user", "content": "hi"}]},
            "n",
        ),
    ],
)
def test_openai_errors(stack: FakeStack, path: str, body: dict, param: str) -> None:
    r = post(stack, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or err["message"])


def test_openai_client_raises_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="x", max_tokens=1, top_p=5)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="default", max_tokens=1, messages=[{"role": "user", "content": "x" * 2000}]
        )


def test_mid_stream_error_event(stack: FakeStack) -> None:
    """A request the workers reject after the stream started ends with an error event."""
    body = {"model": "default", "prompt": "x", "max_tokens": 50, "stream": True, "rid": "bad-later"}
    stack.worker.tick_s = 0.05
    try:
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            stack.worker.active[last_received(stack).rid].finish = {
                "type": "abort",
                "message": "grammar failed",
                "status_code": 400,
            }
            events = sse_events(lines)
    finally:
        stack.worker.tick_s = 0.005
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "grammar failed"


# ---------------------------------------------------------------------- metrics, auth, death
def test_metrics(stack: FakeStack) -> None:
    post(
        stack, "/generate", {"text": "m", "sampling_params": {"max_new_tokens": 3}, "stream": True}
    )
    text = httpx.get(stack.url + "/metrics").text
    for name in (
        "radixlm_time_to_first_token_seconds_bucket",
        "radixlm_inter_token_latency_seconds_bucket",
        "radixlm_e2e_request_latency_seconds_count",
        "radixlm_num_running_reqs",
        "radixlm_token_usage",
        "radixlm_prompt_tokens_total",
        "radixlm_generation_tokens_total",
        "radixlm_cache_hit_rate",
    ):
        assert name in text, name
    count = [
        ln for ln in text.splitlines() if ln.startswith("radixlm_e2e_request_latency_seconds_count")
    ][0]
    assert float(count.split()[-1]) > 0


def test_api_key(tmp_path) -> None:
    s = FakeStack(tmp_path, api_key=TOKEN)
    try:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        assert httpx.post(s.url + "/generate", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        r = httpx.post(s.url + "/generate", json=body, headers=wrong)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.post(s.url + "/generate", json=body, headers=good).status_code == 200
        assert httpx.get(s.url + "/get_server_info").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/ready").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key=TOKEN, max_retries=0)
        assert ok.models.list().data[0].id == "fake-model"
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        s.close()


def test_dead_worker_fails_fast(tmp_path) -> None:
    s = FakeStack(tmp_path, tick_s=0.05)
    try:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 100}, "stream": True}
        with httpx.stream("POST", s.url + "/generate", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            s.tm.mark_dead("the scheduler process exited (exit code -9)")
            events = sse_events(lines)
        assert events[-2]["error"]["code"] == 503
        assert httpx.get(s.url + "/health").status_code == 503
        assert httpx.get(s.url + "/ready").status_code == 503
        t0 = time.monotonic()
        r = httpx.post(s.url + "/generate", json={"text": "hi"}, timeout=10)
        assert r.status_code == 503 and time.monotonic() - t0 < 1.0
        assert "exit code -9" in r.json()["error"]["message"]
    finally:
        s.close()


def test_log_requests_writes_one_line_per_finished_request(tmp_path_factory, caplog) -> None:
    s = FakeStack(tmp_path_factory.mktemp("logreq"), log_requests=True)
    try:
        with caplog.at_level("INFO", logger="radixlm.srt.managers.request_log"):
            body = {
                "text": "secret words",
                "rid": "job-1",
                "sampling_params": {"max_new_tokens": 3},
            }
            assert httpx.post(s.url + "/generate", json=body, timeout=30).status_code == 200
        lines = [r.getMessage() for r in caplog.records if "job-1" in r.getMessage()]
        assert len(lines) == 1 and "finished (length)" in lines[0] and "completion 3" in lines[0]
        assert "secret" not in caplog.text  # no prompt or output text
    finally:
        s.close()


def test_log_requests_level_2_as_json_lines_in_a_folder(tmp_path_factory) -> None:
    """SGLang's --log-requests-level 2 with --log-requests-format json and a folder target: one
    JSON object a line with the sampling parameters, the prompt and the output."""
    folder = tmp_path_factory.mktemp("logreq2") / "logs"
    s = FakeStack(
        tmp_path_factory.mktemp("logreq2s"),
        log_requests=True,
        log_requests_level=2,
        log_requests_format="json",
        log_requests_target=(str(folder),),
    )
    try:
        body = {
            "text": "secret words",
            "rid": "job-2",
            "sampling_params": {"max_new_tokens": 3, "temperature": 0.5},
        }
        r = httpx.post(s.url + "/generate", json=body, timeout=30)
        assert r.status_code == 200
    finally:
        s.close()
    lines = (folder / "requests.log").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["rid"] == "job-2" and rec["finish_reason"]["type"] == "length"
    assert rec["completion_tokens"] == 3 and rec["prompt"] == "secret words"
    assert rec["output"] == r.json()["text"]
    assert rec["sampling_params"] == {"max_new_tokens": 3, "temperature": 0.5}
