"""Strict requests, one request lifecycle owner, request isolation, admin routes: the HTTP
process for real (uvicorn, app, TokenizerManager, ZMQ) over the fake worker of fake_stack.py.
Every test ends with /health 200, no request state left and the idle KV pool adding up."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
from fake_stack import CONTEXT_LENGTH, FakeStack

ADMIN = "admin-key"
USER = "user-key"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "default", "prompt": "hi"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeStack]:
    s = FakeStack(tmp_path_factory.mktemp("ipc"), default_max_tokens=7)
    yield s
    s.close()


def assert_clean(url: str, stack: FakeStack | None = None) -> None:
    """/health is 200, no request state is left once idle, and the KV pool adds up."""
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    deadline = time.monotonic() + 3
    info = httpx.get(url + "/get_server_info", timeout=5, headers=auth(ADMIN)).json()
    while info["num_request_states"] and time.monotonic() < deadline:
        time.sleep(0.05)
        info = httpx.get(url + "/get_server_info", timeout=5, headers=auth(ADMIN)).json()
    assert info["num_request_states"] == 0, info["num_request_states"]
    pool = info["kv_pool"]
    assert pool["available"] + pool["evictable"] + pool["protected"] == pool["max_total_tokens"]
    if stack is not None:
        stack.tm.assert_no_requests()


@pytest.fixture(autouse=True)
def _clean(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack" in request.fixturenames:
        s = request.getfixturevalue("stack")
        assert_clean(s.url, s)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(stack: FakeStack, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=30, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return err


# ---------------------------------------------------------------------- content type, size
@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/abort_request"])
def test_json_only_as_application_json(
    stack: FakeStack, path: str, content_type: str | None
) -> None:
    """A browser sends text/plain and form bodies cross-origin without a CORS preflight."""
    headers = {"Content-Type": content_type} if content_type else {}
    body = orjson.dumps({**COMP, "text": "hi", "abort_all": True})
    r = httpx.post(stack.url + path, content=body, headers=headers, timeout=10)
    err = error_of(r, 415)
    assert (content_type or "none").split(";")[0] in err["message"]
    assert "application/json" in err["message"]


def test_json_with_charset_is_served(stack: FakeStack) -> None:
    body = orjson.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    r = httpx.post(
        stack.url + "/generate",
        content=body,
        timeout=10,
        headers={"Content-Type": "Application/JSON; charset=utf-8"},
    )
    assert r.status_code == 200, r.text


def test_body_over_the_limit_is_413(stack: FakeStack) -> None:
    big = orjson.dumps({"text": "x" * (33 * 2**20)})
    err = error_of(
        httpx.post(
            stack.url + "/generate",
            content=big,
            timeout=60,
            headers={"Content-Type": "application/json"},
        ),
        413,
    )
    assert "MiB" in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it arrives
        for i in range(0, len(big), 2**20):
            yield big[i : i + 2**20]

    r = httpx.post(
        stack.url + "/generate",
        content=chunks(),
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    error_of(r, 413)


# ---------------------------------------------------------------------- strict types
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMP, "max_tokens": "10"}, "max_tokens"),
        ("/v1/completions", {**COMP, "stream": "yes"}, "stream"),
        ("/v1/completions", {**COMP, "n": True}, "n"),
        ("/v1/completions", {**COMP, "temperature": "0.5"}, "temperature"),
        ("/v1/completions", {**COMP, "prompt": [1, True]}, "prompt"),
        ("/v1/completions", {**COMP, "echo": 1}, "echo"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 5.0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "model": 123}, "model"),
        ("/generate", {"text": "hi", "stream": "yes"}, "stream"),
        ("/generate", {"input_ids": [1, True]}, "input_ids"),
        ("/generate", {"text": "hi", "return_logprob": 1}, "return_logprob"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": "10"}},
            "max_new_tokens",
        ),
        ("/generate", {"text": "hi", "sampling_params": {"n": True}}, "n"),
        ("/generate", [{"text": "hi"}], "JSON object"),
    ],
)
def test_types_are_never_coerced(stack: FakeStack, path: str, body: object, param: str) -> None:
    err = error_of(post(stack, path, body), 400)
    assert param in (err["param"] or "") + err["message"], err


# ---------------------------------------------------------------------- ranges, both APIs
OUT_OF_RANGE = [
    ({"seed": 2**63}, "seed"),
    ({"seed": -1}, "seed"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["s"] * 65}, "stop"),
    ({"stop": "s" * 1025}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"n": 129}, "n"),
    ({"n": 10000}, "n"),
    ({"n": 0}, "n"),
]


@pytest.mark.parametrize(("field", "param"), OUT_OF_RANGE, ids=[p for _, p in OUT_OF_RANGE])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_out_of_range_is_400_naming_the_parameter(
    stack: FakeStack, path: str, field: dict, param: str
) -> None:
    if path == "/generate":
        body: dict = {"text": "hi", "sampling_params": {"max_new_tokens": 2, **field}}
    else:
        body = {**(CHAT if "chat" in path else COMP), "max_tokens": 2, **field}
    err = error_of(post(stack, path, body), 400)
    assert param in (err["param"] or "") + err["message"], err


def test_seed_at_the_top_of_the_range_with_n_2(stack: FakeStack) -> None:
    """Was a 500 (orjson cannot encode seed + 1 = 2**64) leaving request states behind."""
    r = post(stack, "/v1/completions", {**COMP, "max_tokens": 2, "n": 2, "seed": 2**64 - 1})
    error_of(r, 400)
    top = 2**63 - 1
    r = post(stack, "/v1/completions", {**COMP, "max_tokens": 2, "n": 2, "seed": top})
    assert r.status_code == 200, r.text
    seeds = [m.sampling_params["seed"] for m in list(stack.worker.received.values())[-2:]]
    assert seeds == [top, 0]


@pytest.mark.parametrize("ids", [[-1], [2**40], [5, 2**63], [[1, 2], [-3]]])
def test_bad_token_ids_are_400_on_both_apis(stack: FakeStack, ids: list) -> None:
    """Prompt token ids were decoded before they were checked: 500 and leftover states."""
    err = error_of(
        post(stack, "/v1/completions", {**COMP, "prompt": ids, "max_tokens": 2, "n": 2}), 400
    )
    assert err["param"] == "prompt" and "token ids" in err["message"]
    err = error_of(post(stack, "/generate", {"input_ids": ids}), 400)
    assert err["param"] == "input_ids"
    error_of(post(stack, "/detokenize", {"tokens": ids}), 400)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMP, "logprobs": 6}, "logprobs"),
        ("/v1/completions", {**COMP, "logprobs": -1}, "logprobs"),
        ("/v1/completions", {**COMP, "max_tokens": -1}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
        (
            "/generate",
            {"text": "hi", "return_logprob": True, "top_logprobs_num": 21},
            "top_logprobs_num",
        ),
        (
            "/generate",
            {"text": "hi", "return_logprob": True, "logprob_start_len": -2},
            "logprob_start_len",
        ),
    ],
)
def test_logprob_and_length_bounds(stack: FakeStack, path: str, body: dict, param: str) -> None:
    err = error_of(post(stack, path, body), 400)
    assert param in (err["param"] or "") + err["message"], err


# ---------------------------------------------------------------------- prompt size
def test_huge_prompt_is_refused_before_tokenizing(stack: FakeStack) -> None:
    text = "hello world " * 2_000_000  # 24 MB: tokenizing it would take tens of seconds
    for path, body in [
        ("/generate", {"text": text}),
        ("/v1/completions", {**COMP, "prompt": text}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": text}]}),
        ("/tokenize", {"prompt": text}),
    ]:
        t0 = time.monotonic()
        err = error_of(post(stack, path, body), 400)
        assert time.monotonic() - t0 < 3.0 and "characters" in err["message"], err


def test_tokenization_runs_off_the_event_loop(stack: FakeStack) -> None:
    """One /tokenize call with ~1.5 M characters (each prompt under the size limit) takes
    about a second to tokenize; /health must keep answering meanwhile."""
    prompt = "the quick brown fox " * (stack.tm.max_prompt_chars // 20)
    body = {"prompt": [prompt] * (1_500_000 // len(prompt))}
    gaps: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            assert httpx.get(stack.url + "/health", timeout=10).status_code == 200
            gaps.append(time.monotonic() - t0)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        t0 = time.monotonic()
        assert post(stack, "/tokenize", body).status_code == 200
        elapsed = time.monotonic() - t0
    finally:
        done.set()
        poller.join()
    assert elapsed > 0.3, f"too little work to tell ({elapsed:.2f}s)"
    assert max(gaps) < elapsed / 2, (max(gaps), elapsed)


def test_chat_default_max_tokens_is_not_the_whole_context(stack: FakeStack) -> None:
    r = post(stack, "/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    assert list(stack.worker.received.values())[-1].sampling_params["max_new_tokens"] == 7
    assert r.json()["usage"]["completion_tokens"] == 7


# ---------------------------------------------------------------------- OpenAI compatibility
def test_refusal_is_null_on_chat_messages(stack: FakeStack) -> None:
    client = openai.OpenAI(
        base_url=stack.url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True
    )
    r = client.chat.completions.create(**CHAT, max_tokens=2)
    assert r.choices[0].message.refusal is None
    assert "refusal" in post(stack, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]
    chunks = list(client.chat.completions.create(**CHAT, max_tokens=2, stream=True))
    assert chunks[0].choices[0].delta.refusal is None


def test_unknown_openai_fields_are_ignored(stack: FakeStack) -> None:
    extra = {
        "user": "u",
        "store": False,
        "metadata": {"a": "b"},
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "some_future_field": [1],
        "modalities": ["text"],
        "tools": [],
        "tool_choice": "none",
        "best_of": 1,
        "suffix": None,
        "prediction": {"type": "content", "content": "x"},
        "verbosity": "medium",
    }
    assert post(stack, "/v1/chat/completions", {**CHAT, **extra}).status_code == 200
    assert post(stack, "/v1/completions", {**COMP, **extra}).status_code == 200


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
        ("/v1/completions", {"best_of": 3}),
        ("/v1/completions", {"suffix": "end"}),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}),
        ("/v1/chat/completions", {"web_search_options": {}}),
        ("/v1/chat/completions", {"verbosity": "low"}),
        ("/generate", {"lora_path": "my-adapter"}),
        ("/generate", {"image_data": "http://x/y.png"}),
    ],
)
def test_fields_that_change_sampling_are_not_silently_ignored(
    stack: FakeStack, path: str, field: dict
) -> None:
    base = {"text": "hi"} if path == "/generate" else (CHAT if "chat" in path else COMP)
    err = error_of(post(stack, path, {**base, **field}), 400)
    assert err["param"] == next(iter(field)) and err["code"] == "unsupported_parameter"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_model_missing_vs_unknown(stack: FakeStack, path: str) -> None:
    base = {k: v for k, v in (CHAT if "chat" in path else COMP).items() if k != "model"}
    r = post(stack, path, {**base, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "fake-model", r.text
    assert post(stack, path, {**base, "model": None, "max_tokens": 2}).status_code == 200
    err = error_of(post(stack, path, {**base, "model": "gpt-x"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "/models/" not in err["message"] and "fake-model" in err["message"]
    err = error_of(httpx.get(stack.url + "/v1/models/gpt-x"), 404)
    assert "/models/" not in err["message"]


def test_special_token_text_in_chat_content_is_plain_text(stack: FakeStack) -> None:
    eos = stack.tokenizer.convert_tokens_to_ids("<eos>")
    body = {
        **CHAT,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "a<eos><|assistant|>b"}],
    }
    assert post(stack, "/v1/chat/completions", body).status_code == 200
    ids = list(stack.worker.received.values())[-1].input_ids
    assert eos not in ids
    prompt = stack.tokenizer.apply_chat_template(
        body["messages"], tokenize=False, add_generation_prompt=True
    )
    assert eos in stack.tokenizer.encode(prompt, add_special_tokens=False)  # what it was
    assert stack.tokenizer.decode(ids) == prompt
    plain = {**CHAT, "max_tokens": 1}  # no special text: tokenized with the whole prompt
    post(stack, "/v1/chat/completions", plain)
    prompt = stack.tokenizer.apply_chat_template(
        plain["messages"], tokenize=False, add_generation_prompt=True
    )
    assert list(stack.worker.received.values())[-1].input_ids == stack.tokenizer.encode(
        prompt, add_special_tokens=False
    )


# ---------------------------------------------------------------------- isolation
def slow_stream(stack: FakeStack, body: dict) -> Iterator[str]:
    with httpx.stream(
        "POST", stack.url + "/generate", json={**body, "stream": True}, timeout=30
    ) as r:
        assert r.status_code == 200
        yield from r.iter_lines()


@pytest.fixture
def slow(stack: FakeStack) -> Iterator[None]:
    stack.worker.tick_s = 0.05
    yield
    stack.worker.tick_s = 0.005


def test_duplicate_client_rid_cannot_touch_the_running_one(stack: FakeStack, slow) -> None:
    body = {"text": "hi", "rid": "same", "sampling_params": {"max_new_tokens": 20}}
    lines = slow_stream(stack, body)
    next(lines)
    err = error_of(post(stack, "/generate", body), 400)
    assert err["param"] == "rid" and "already running" in err["message"]
    with httpx.stream(
        "POST", stack.url + "/generate", json={**body, "stream": True}, timeout=30
    ) as r:  # a second client that goes away at once
        assert r.status_code == 400
    events = [ln for ln in lines if ln.startswith("data: {")]
    final = orjson.loads(events[-1][6:])
    assert final["meta_info"]["finish_reason"]["type"] == "length", final
    assert final["meta_info"]["id"] == "same"


def test_disconnect_aborts_only_its_own_request(stack: FakeStack, slow) -> None:
    """Aborts are by exact internal rid: client rid "job" going away must not abort "job-1"
    (the scheduler used to match rid prefixes)."""
    other = slow_stream(
        stack, {"text": "hi", "rid": "job-1", "sampling_params": {"max_new_tokens": 20}}
    )
    next(other)
    with httpx.stream(
        "POST",
        stack.url + "/generate",
        timeout=30,
        json={
            "text": "hi",
            "rid": "job",
            "stream": True,
            "sampling_params": {"max_new_tokens": 200},
        },
    ) as r:
        next(r.iter_lines())
    events = [ln for ln in other if ln.startswith("data: {")]
    assert orjson.loads(events[-1][6:])["meta_info"]["finish_reason"]["type"] == "length"
    assert all(len(a.rid) == 32 and not a.abort_all for a in stack.worker.aborts)


def test_an_empty_rid_is_refused_on_every_route(stack: FakeStack) -> None:
    """``/abort_request`` reads ``rid: ""`` as no rid, so such a request could not be aborted."""
    for path, body in [
        ("/generate", {"text": "hi", "rid": ""}),
        ("/generate", {"text": ["a", "b"], "rid": ["x", ""]}),
        ("/v1/completions", {"model": "default", "prompt": "hi", "rid": ""}),
        (
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "user", "content": "hi"}], "rid": ""},
        ),
    ]:
        err = error_of(post(stack, path, body), 400)
        assert err["param"] == "rid" and "non-empty" in err["message"], (path, err)


def test_abort_by_rid_is_exact_and_covers_every_sample(stack: FakeStack, slow) -> None:
    lines = slow_stream(
        stack, {"text": "hi", "rid": "many", "sampling_params": {"max_new_tokens": 100, "n": 3}}
    )
    next(lines)
    assert post(stack, "/abort_request", {"rid": "man"}).json()["num_aborted"] == 0
    assert post(stack, "/abort_request", {"rid": "many"}).json()["num_aborted"] == 3
    finals = [orjson.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    finals = [e for e in finals if e["meta_info"]["finish_reason"]]
    assert sorted(e["meta_info"]["id"] for e in finals) == ["many_0", "many_1", "many_2"]
    assert {e["meta_info"]["finish_reason"]["type"] for e in finals} == {"abort"}


def test_abort_one_sample_by_its_shown_rid(stack: FakeStack, slow) -> None:
    body = {"model": "default", "prompt": ["a", "b"], "n": 2, "max_tokens": 30, "rid": "cmp"}
    with httpx.stream(
        "POST", stack.url + "/v1/completions", json={**body, "stream": True}, timeout=30
    ) as r:
        lines = r.iter_lines()
        next(lines)
        assert post(stack, "/abort_request", {"rid": "cmp-1-0"}).json()["num_aborted"] == 1
        events = [ln for ln in lines if ln.startswith("data: ")]
    assert "aborted" in events[-2]  # an OpenAI stream reports the abort as an error event


# ---------------------------------------------------------------------- admin routes
@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeStack]:
    s = FakeStack(tmp_path_factory.mktemp("keyed"), api_key=USER, admin_api_key=ADMIN)
    yield s
    s.close()


def test_admin_routes_need_the_admin_key(keyed: FakeStack) -> None:
    url = keyed.url
    for body, path in [({}, "/flush_cache"), ({"abort_all": True}, "/abort_request")]:
        error_of(httpx.post(url + path, json=body), 401)
        assert (
            error_of(httpx.post(url + path, json=body, headers=auth(USER)), 403)["code"]
            == "admin_key_required"
        )
        assert httpx.post(url + path, json=body, headers=auth(ADMIN)).status_code == 200
    update = {"model_path": "/elsewhere"}  # (the fake scheduler answers any control)
    error_of(httpx.post(url + "/update_weights_from_disk", json=update), 401)
    error_of(httpx.post(url + "/update_weights_from_disk", json=update, headers=auth(USER)), 403)
    assert (
        httpx.post(url + "/abort_request", json={"rid": "x"}, headers=auth(USER)).status_code == 200
    )
    r = httpx.post(url + "/generate", headers=auth(ADMIN), json={"text": "hi"})
    assert r.status_code == 200  # the admin key is good on every route
    assert_clean(url, keyed)


def test_admin_routes_are_post_only(keyed: FakeStack) -> None:
    error_of(httpx.get(keyed.url + "/flush_cache", headers=auth(ADMIN)), 405)
    error_of(httpx.get(keyed.url + "/abort_request", headers=auth(ADMIN)), 405)


def test_api_key_guards_admin_routes_without_an_admin_key(tmp_path) -> None:
    s = FakeStack(tmp_path, api_key=USER)
    try:
        error_of(httpx.post(s.url + "/flush_cache"), 401)
        assert httpx.post(s.url + "/flush_cache", headers=auth(USER)).status_code == 200
        r = httpx.post(s.url + "/abort_request", json={"abort_all": True}, headers=auth(USER))
        assert r.status_code == 200
        info = httpx.get(s.url + "/get_server_info", headers=auth(USER)).json()
        assert "api_key" not in info and "admin_api_key" not in info
    finally:
        s.close()


def test_openapi_declares_the_request_bodies(stack: FakeStack) -> None:
    spec = httpx.get(stack.url + "/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert "messages" in spec["components"]["schemas"][ref]["properties"]
    assert "get" not in spec["paths"]["/flush_cache"]
    assert "415" in spec["paths"]["/generate"]["post"]["responses"]


def test_context_length_still_enforced(stack: FakeStack) -> None:
    err = error_of(
        post(
            stack,
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": CONTEXT_LENGTH}},
        ),
        400,
    )
    assert err["param"] == "max_new_tokens"


@pytest.mark.parametrize(
    "body",
    [
        {**CHAT, "messages": [{"role": "user", "content": "hi "}] * 200_000},
        {
            **CHAT,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 200_000}],
        },
        {"text": ["hi"] * 300_000},
    ],
    ids=["messages", "content-parts", "native-batch"],
)
def test_many_items_are_refused_before_model_validation(stack: FakeStack, body: dict) -> None:
    """Validating 200 000 pydantic models holds the GIL for seconds (it stalled /health)."""
    path = "/v1/chat/completions" if "messages" in body else "/generate"
    t0 = time.monotonic()
    err = error_of(post(stack, path, body), 400)
    assert time.monotonic() - t0 < 1.5 and "at most" in err["message"], err


def test_long_token_id_prompt_is_refused_before_validation(stack: FakeStack) -> None:
    for path, body in [
        ("/generate", {"input_ids": [5] * 1_600_000}),
        ("/v1/completions", {**COMP, "prompt": [5] * 1_600_000}),
    ]:
        t0 = time.monotonic()
        err = error_of(post(stack, path, body), 400)
        assert time.monotonic() - t0 < 1.5 and "context" in err["message"], err


def test_anthropic_clients_send_the_key_as_x_api_key(keyed: FakeStack) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    url = keyed.url + "/v1/messages/count_tokens"
    assert httpx.post(url, json=body, headers={"x-api-key": USER}).status_code == 200
    denied = httpx.post(url, json=body, headers={"x-api-key": "wrong"})
    assert denied.status_code == 401
    assert denied.json()["type"] == "error"  # Anthropic's envelope, as the routes answer
    assert denied.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(url, json=body).status_code == 401
    other = httpx.post(keyed.url + "/v1/chat/completions", json=body)
    assert other.status_code == 401 and "type" not in other.json()  # OpenAI's shape
    admin = httpx.post(keyed.url + "/flush_cache", headers={"x-api-key": ADMIN})
    assert admin.status_code == 200


def test_sglangs_other_weight_sync_routes_say_what_works(keyed: FakeStack) -> None:
    for path in ("/update_weights_from_tensor", "/init_weights_update_group"):
        body = {"serialized_named_tensors": ["gASV"], "flush_cache": True}
        assert httpx.post(keyed.url + path, json=body).status_code == 401  # admin routes
        err = error_of(httpx.post(keyed.url + path, json=body, headers=auth(ADMIN)), 400)
        assert path in err["message"] and "/update_weights_from_disk" in err["message"]
