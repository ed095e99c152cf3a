"""Hostile clients against a real `radixlm serve` on 127.0.0.1: malformed bodies, out-of-range
parameters, token ids, context and pool limits, hostile grammars, huge payloads, the API key on
every route, disconnects and aborts in every phase, an abort storm, 128+ concurrent mixed
requests against a serial run, and the stream protocol.

What is checked is what a user of SGLang or vLLM expects: a 4xx in the OpenAI error shape (never a
5xx, never a hang: every client call has a timeout), and after every test the shared check of
``hostile_util.assert_clean``: /health is 200, no request state is left and the idle KV pool adds
up. Two servers over a tiny random Llama with SmolLM2's tokenizer (fast start): the main one
(context 512, KV pool 2048) and one with ``--api-key`` and a 256-token pool.
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest
from hostile_util import (
    HTTP_TIMEOUT_S,
    Failures,
    LiveServer,
    assert_4xx,
    assert_clean,
    assert_ok_or_4xx,
    assert_openai_error,
    raw_request,
    read_until,
    start_all,
    stream,
    stream_text,
    wait_for,
)

pytestmark = pytest.mark.slow

CONTEXT = 512
POOL = 2048
SMALL_POOL = 256
API_KEY = "hostile-test-key"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    common = ["--model-path", str(tiny_llama_dir), "--grammar-compile-timeout-s", "10"]
    main = LiveServer(
        [*common, "--context-length", str(CONTEXT), "--max-total-tokens", str(POOL)],
        tmp_path_factory.mktemp("main"),
    )
    keyed = LiveServer(
        [*common, "--max-total-tokens", str(SMALL_POOL)],
        tmp_path_factory.mktemp("keyed"),
        api_key=API_KEY,
    )
    start_all([main, keyed])
    yield main, keyed
    main.stop()
    keyed.stop()


@pytest.fixture(scope="module")
def server(servers) -> LiveServer:
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers) -> LiveServer:
    return servers[1]


@pytest.fixture(autouse=True)
def leak_check(servers):
    """Every test starts on healthy servers and ends with the shared check on both."""
    for s in servers:
        s.ensure_running()
    yield
    for s in servers:
        assert_clean(s)


def gen(
    server: LiveServer, text: str = "Hello there", timeout: float = HTTP_TIMEOUT_S, **sp: Any
) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, **GREEDY, **sp}}
    return server.post("/generate", body, timeout=timeout)


def ids_prompt(n: int, token_id: int = 1000) -> list[int]:
    return [token_id + (i % 7) for i in range(n)]


# ---------------------------------------------------------------------- malformed bodies
NESTED = b"[" * 100_000 + b"]" * 100_000
MALFORMED = {
    "not-json": b"{oops",
    "empty": b"",
    "array": b"[]",
    "array-of-objects": b'[{"text": "hi"}]',
    "number": b"42",
    "null": b"null",
    "string": b'"text"',
    "true": b"true",
    "nested-array": NESTED,
    "nested-object": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "invalid-utf8": b'{"text": "\xff\xfe\xfd", "prompt": "\xc3\x28", "model": "default"}',
    "lone-surrogate": b'{"text": "\\ud800", "prompt": "\\ud800", "model": "default", '
    b'"messages": [{"role": "user", "content": "\\udfff"}]}',
    "nan": b'{"text": "hi", "sampling_params": {"temperature": NaN}}',
    "trailing-garbage": b'{"text": "hi"} {"text": "again"}',
    "form": b"text=hi&model=default",
}
POST_ROUTES = [
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/abort_request",
    "/tokenize",
    "/detokenize",
]


@pytest.mark.parametrize("route", POST_ROUTES)
def test_malformed_body_is_400(server: LiveServer, route: str) -> None:
    """Sent as application/json: each is a 400 (a 413 or 415 would mean the check misfired)."""
    failures = Failures()
    for name in sorted(MALFORMED):
        failures.check(
            name,
            lambda b=MALFORMED[name]: assert_openai_error(
                server.post(route, raw=b, timeout=20), (400, 422)
            ),
        )
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        failures.check(
            ctype,
            lambda c=ctype: assert_openai_error(
                server.post(route, raw=b"text=hi", headers={"Content-Type": c}, timeout=20),
                (400, 415),
            ),
        )
    failures.assert_none()


def test_wrong_field_types_are_400(server: LiveServer) -> None:
    cases = [
        ("/generate", {"text": 5}),
        ("/generate", {"text": {"a": 1}}),
        ("/generate", {"text": "hi", "sampling_params": "greedy"}),
        ("/generate", {"text": "hi", "sampling_params": [1]}),
        ("/generate", {"text": "hi", "stream": "yes"}),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {}, {}]}),
        ("/generate", {"text": "hi", "rid": 5}),
        ("/generate", {"text": "hi", "input_ids": [1]}),
        ("/generate", {}),
        ("/generate", {"text": []}),
        ("/generate", {"text": ""}),
        ("/generate", {"input_ids": []}),
        ("/generate", {"input_ids": [[]]}),
        ("/generate", {"input_ids": [[[1]]]}),
        ("/v1/completions", {"model": "default"}),
        ("/v1/completions", {"model": "default", "prompt": []}),
        ("/v1/completions", {"model": "default", "prompt": [[]]}),
        ("/v1/completions", {"model": "default", "prompt": {"x": 1}}),
        ("/v1/chat/completions", {"model": "default", "messages": []}),
        ("/v1/chat/completions", {"model": "default", "messages": "hi"}),
        ("/v1/chat/completions", {"model": "default", "messages": [{"content": "no role"}]}),
        (
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "wizard", "content": "x"}]},
        ),
        (
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            },
        ),
        ("/abort_request", {"rid": ["a"]}),
        ("/tokenize", {"prompt": 5}),
        ("/detokenize", {"tokens": "abc"}),
    ]
    failures = Failures()
    for path, body in cases:
        failures.check(
            (path, body), lambda p=path, b=body: assert_openai_error(server.post(p, b, timeout=20))
        )
    failures.assert_none()


# ---------------------------------------------------------------------- sampling values
BAD_SAMPLING = [  # native name, value: each must be a 400
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("temperature", [1]),
    ("temperature", True),
    ("top_p", 0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", "1"),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", "5"),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("frequency_penalty", -2.1),
    ("frequency_penalty", 2.1),
    ("presence_penalty", -2.1),
    ("presence_penalty", 2.1),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("seed", "abc"),
    ("seed", 1.5),
    ("n", 0),
    ("n", -1),
    ("n", "two"),
    ("n", 1.5),
    ("n", 100_000),
    ("max_new_tokens", -1),
    ("max_new_tokens", "10"),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", 10**9),
    ("max_new_tokens", 2**63),
    ("max_new_tokens", 2**70),
    ("min_new_tokens", 5),
    ("min_new_tokens", -1),
    ("logit_bias", {"abc": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"49152": 1}),
    ("logit_bias", {"1": "x"}),
    ("logit_bias", [1, 2]),
    ("logit_bias", {str(2**40): 1}),
    ("stop", ""),
    ("stop", [""]),
    ("stop", [1, 2]),
    ("stop", {"a": 1}),
    ("stop", [None]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [49152]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", [2**40]),
    ("choices", []),
    ("choices", [1]),
    ("no_such_param", 1),
]
# values a server may take (200, finished) or refuse (4xx), but never a 5xx or a hang
EXTREME_SAMPLING = [
    {"temperature": 1e30},
    {"temperature": 1e-30},
    {"temperature": 1e-6, "seed": 3},
    {"temperature": 1.0, "top_k": 2**31},
    {"temperature": 1.0, "top_k": 2**63},
    {"temperature": 1.0, "top_p": 1e-30},
    {"temperature": 1.0, "min_p": 1.0},
    {"temperature": 1.0, "seed": -1},
    {"temperature": 1.0, "seed": 2**63},
    {"temperature": 1.0, "seed": 2**64},
    {"temperature": 1.0, "seed": 2**200},
    {"temperature": 1.0, "repetition_penalty": 1e-30},
    {
        "temperature": 1.0,
        "repetition_penalty": 2.0,
        "frequency_penalty": 2.0,
        "presence_penalty": -2.0,
    },
    {"temperature": 1.0, "logit_bias": {"1000": 1e38}},
    {"temperature": 1.0, "logit_bias": {"1000": -1e38}},
    {"temperature": 0, "logit_bias": {"1000": 3e38, "1001": 3e38}},
    {"temperature": 1.0, "logit_bias": {str(i): 100 for i in range(2000)}},
    {"stop": ["x"] * 5000},
    {"stop": ["a" * 100_000]},
    {"stop_token_ids": list(range(5000))},
    {"max_new_tokens": 0},
    {"min_new_tokens": 4, "max_new_tokens": 4, "stop_token_ids": [2]},
    {"n": 64, "max_new_tokens": 1},
]


def test_out_of_range_sampling_native_is_400(server: LiveServer) -> None:
    failures = Failures()
    for name, value in BAD_SAMPLING:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, name: value}}
        failures.check(
            (name, value),
            lambda b=body: assert_openai_error(server.post("/generate", b, timeout=20)),
        )
    failures.assert_none()


OPENAI_BAD = [  # top-level OpenAI (and SGLang extra) fields: each must be a 400
    {"temperature": -1},
    {"temperature": "x"},
    {"top_p": 1.5},
    {"top_p": 0},
    {"n": 0},
    {"n": 100_000},
    {"max_tokens": -1},
    {"max_tokens": 10**9},
    {"max_tokens": 2**70},
    {"presence_penalty": 3},
    {"frequency_penalty": -3},
    {"logit_bias": {"x": 1}},
    {"logit_bias": {"99999999": 1}},
    {"stop": [""]},
    {"stop": 5},
    {"seed": "x"},
    {"top_k": 0},
    {"min_p": 2},
    {"repetition_penalty": 0},
    {"stop_token_ids": [-5]},
    {"stream": "yes"},
    {"stream_options": "yes"},
    {"regex": 5},
    {"min_tokens": 10**9},
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_range_sampling_openai_is_400(server: LiveServer, route: str) -> None:
    failures = Failures()
    for extra in OPENAI_BAD + [
        {"max_completion_tokens": -1},
        {"top_logprobs": 21, "logprobs": True},
    ]:
        if "max_completion_tokens" in extra and route == "/v1/completions":
            extra = {"logprobs": 6}
        if "top_logprobs" in extra and route == "/v1/completions":
            extra = {"logprobs": -1}
        body = {"model": "default", "max_tokens": 2, **openai_prompt(route), **extra}
        failures.check(extra, lambda b=body: assert_openai_error(server.post(route, b, timeout=20)))
    failures.assert_none()


def openai_prompt(route: str, text: str = "Hello there") -> dict[str, Any]:
    if route.endswith("chat/completions"):
        return {"messages": [{"role": "user", "content": text}]}
    return {"prompt": text}


def test_extreme_sampling_values_never_5xx(server: LiveServer) -> None:
    failures = Failures()
    for sp in EXTREME_SAMPLING:
        body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 4, **sp}}
        failures.check(sp, lambda b=body: assert_ok_or_4xx(server.post("/generate", b, timeout=30)))
    failures.assert_none()
    assert gen(server).status_code == 200


def test_one_bad_request_does_not_fail_its_batch_mates(server: LiveServer) -> None:
    """A request that breaks sampling (a seed torch cannot take, an infinite bias) must fail
    alone: greedy requests running with it still finish normally."""
    bad = [
        {"temperature": 1.0, "seed": 2**64},
        {"temperature": 1.0, "seed": 2**200},
        {"temperature": 1.0, "logit_bias": {"1000": 3e38}},
        {"temperature": 1.0, "repetition_penalty": 1e-30},
    ]
    ref = gen(server, "The good request", max_new_tokens=24, ignore_eos=True).json()["text"]
    failures = Failures()
    with ThreadPoolExecutor(8) as pool:
        for sp in bad:
            good = [
                pool.submit(gen, server, "The good request", max_new_tokens=24, ignore_eos=True)
                for _ in range(3)
            ]
            hostile = pool.submit(gen, server, "The bad request", max_new_tokens=24, **sp)
            failures.check(("bad", sp), assert_ok_or_4xx, hostile.result())
            for f in good:
                failures.check(("good next to", sp), _assert_text, f.result(), ref)
    failures.assert_none()


def _assert_text(r: httpx.Response, text: str) -> None:
    assert r.status_code == 200, r.text[:300]
    assert r.json()["text"] == text


# ---------------------------------------------------------------------- logprobs
def test_logprob_bounds(server: LiveServer) -> None:
    prompt = ids_prompt(6)
    native = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 2, **GREEDY},
        "return_logprob": True,
    }
    bad = [
        {"top_logprobs_num": 21},
        {"top_logprobs_num": -1},
        {"top_logprobs_num": 10**12},
        {"logprob_start_len": -2},
        {"logprob_start_len": 6},
        {"logprob_start_len": 10**12},
        {"logprob_start_len": "0"},
        {"top_logprobs_num": 1.5},
    ]
    failures = Failures()
    for extra in bad:
        failures.check(
            extra,
            lambda b={**native, **extra}: assert_openai_error(
                server.post("/generate", b, timeout=20)
            ),
        )
    chat = {"model": "default", "max_tokens": 2, **openai_prompt("chat"), "logprobs": True}
    for extra in [
        {"top_logprobs": 21},
        {"top_logprobs": -1},
        {"logprobs": False, "top_logprobs": 3},
    ]:
        failures.check(
            extra,
            lambda b={**chat, **extra}: assert_openai_error(
                server.post("/v1/chat/completions", b, timeout=20)
            ),
        )
    failures.assert_none()
    r = server.post("/generate", {**native, "logprob_start_len": 5, "top_logprobs_num": 20})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == 1
    assert all(len(row) == 20 for row in meta["output_top_logprobs"])
    r = server.post(
        "/v1/completions",
        {"model": "default", "prompt": prompt, "max_tokens": 2, "logprobs": 5, **GREEDY},
    )
    assert r.status_code == 200, r.text
    assert all(len(t) == 5 for t in r.json()["choices"][0]["logprobs"]["top_logprobs"])


# ---------------------------------------------------------------------- token ids
BAD_IDS = [[-1], [49152], [2**31], [2**40], [2**63], [2**64], [1.5], ["a"], [None], [True, 5]]


def test_bad_token_ids_are_400(server: LiveServer) -> None:
    failures = Failures()
    for ids in BAD_IDS:
        native = {"input_ids": [5, *ids], "sampling_params": {"max_new_tokens": 2}}
        failures.check(
            ("generate", ids),
            lambda b=native: assert_openai_error(server.post("/generate", b, timeout=20)),
        )
        batch = {"input_ids": [[5, 6], [5, *ids]], "sampling_params": {"max_new_tokens": 2}}
        failures.check(
            ("generate batch", ids),
            lambda b=batch: assert_openai_error(server.post("/generate", b, timeout=20)),
        )
        oai = {"model": "default", "prompt": [5, *ids], "max_tokens": 2}
        failures.check(
            ("completions", ids),
            lambda b=oai: assert_openai_error(server.post("/v1/completions", b, timeout=20)),
        )
        oai_batch = {"model": "default", "prompt": [[5], [5, *ids]], "max_tokens": 2}
        failures.check(
            ("completions batch", ids),
            lambda b=oai_batch: assert_openai_error(server.post("/v1/completions", b, timeout=20)),
        )
        detok = {"tokens": [5, *ids]}
        failures.check(
            ("detokenize", ids),
            lambda b=detok: assert_openai_error(server.post("/detokenize", b, timeout=20)),
        )
    failures.assert_none()
    vocab = server.info()["vocab_size"]
    r = server.post(
        "/generate",
        {"input_ids": [0, vocab - 1], "sampling_params": {"max_new_tokens": 2, **GREEDY}},
    )
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- context and pool
def test_context_boundary(server: LiveServer) -> None:
    fits = {
        "input_ids": ids_prompt(CONTEXT - 1),
        "sampling_params": {"max_new_tokens": 1, **GREEDY},
    }
    r = server.post("/generate", fits)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 1
    r = server.post(
        "/v1/completions",
        {"model": "default", "prompt": ids_prompt(CONTEXT - 1), "max_tokens": 1, **GREEDY},
    )
    assert r.status_code == 200, r.text
    failures = Failures()
    for n, new in [(CONTEXT, 1), (CONTEXT - 1, 2), (CONTEXT, 0), (CONTEXT + 1, 1)]:
        body = {"input_ids": ids_prompt(n), "sampling_params": {"max_new_tokens": new}}
        failures.check(
            ("generate", n, new), lambda b=body: assert_openai_error(server.post("/generate", b))
        )
        oai = {"model": "default", "prompt": ids_prompt(n), "max_tokens": new or 1}
        failures.check(
            ("completions", n, new),
            lambda b=oai: assert_openai_error(server.post("/v1/completions", b)),
        )
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi " * CONTEXT}]}
    failures.check(
        "chat over the context",
        lambda: assert_openai_error(server.post("/v1/chat/completions", chat)),
    )
    failures.assert_none()


def test_request_larger_than_kv_pool(keyed: LiveServer) -> None:
    """On the 256-token pool (context 2048): a prompt that can never fit, and a prompt whose
    max_new_tokens can never fit, are clear 400s; the server serves normally afterwards."""
    failures = Failures()
    too_long = {"input_ids": ids_prompt(SMALL_POOL + 40), "sampling_params": {"max_new_tokens": 1}}
    failures.check(
        "prompt > pool", lambda: assert_openai_error(keyed.post("/generate", too_long, timeout=20))
    )
    too_much = {
        "input_ids": ids_prompt(100),
        "sampling_params": {"max_new_tokens": SMALL_POOL * 2, "ignore_eos": True, **GREEDY},
    }
    failures.check(
        "prompt + max_new_tokens > pool",
        lambda: assert_openai_error(keyed.post("/generate", too_much, timeout=30)),
    )
    oai = {
        "model": "default",
        "prompt": ids_prompt(100),
        "max_tokens": SMALL_POOL * 2,
        "ignore_eos": True,
    }
    failures.check(
        "completions > pool",
        lambda: assert_openai_error(keyed.post("/v1/completions", oai, timeout=30)),
    )
    failures.assert_none()
    r = keyed.post("/generate", {"text": "still fine", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def test_pool_pressure_queues_and_matches_serial(keyed: LiveServer) -> None:
    """Requests that fit alone but not together (3 x 130 tokens on a 256-token pool) all
    finish with their serial greedy output."""
    bodies = [
        {
            "input_ids": ids_prompt(100, 2000 + 10 * k),
            "sampling_params": {"max_new_tokens": 30, "ignore_eos": True, **GREEDY},
        }
        for k in range(3)
    ]
    serial = [keyed.post("/generate", b, timeout=60).json()["output_ids"] for b in bodies]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda b: keyed.post("/generate", b, timeout=120), bodies))
    assert [o.status_code for o in outs] == [200] * 3, [o.text[:200] for o in outs]
    assert [o.json()["output_ids"] for o in outs] == serial


# ---------------------------------------------------------------------- grammars
def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD_GRAMMARS = {  # must be a 4xx
    "unbalanced-regex": {"regex": "("},
    "bad-class-regex": {"regex": "[a-"},
    "bad-escape-regex": {"regex": "\\"},
    "unbalanced-close-regex": {"regex": "a)|(b"},  # valid only once wrapped as (?:...)$
    "schema-not-json": {"json_schema": "{not json"},
    "schema-bad-type": {"json_schema": {"type": "nonsense"}},
    "schema-not-object": {"json_schema": "42"},
    "schema-bad-pattern": {"json_schema": {"type": "string", "pattern": "("}},
    "ebnf-garbage": {"ebnf": "this is not a grammar ::= ::="},
    "ebnf-no-root": {"ebnf": 'start ::= "a"'},
    "ebnf-undefined-rule": {"ebnf": "root ::= missing"},
    "two-grammars": {"regex": "a+", "json_schema": {"type": "string"}},
    "empty-choices": {"choices": []},
}
HOSTILE_GRAMMARS = {  # a 4xx or a finished answer, in bounded time
    "left-recursion": {"ebnf": "root ::= root"},
    "mutual-recursion": {"ebnf": "root ::= a\na ::= root"},
    "recursive-ref": {"json_schema": {"$ref": "#"}},
    "recursive-defs": {
        "json_schema": {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"next": {"$ref": "#/$defs/n"}},
                    "required": ["next"],
                }
            },
            "$ref": "#/$defs/n",
        }
    },
    "dangling-ref": {"json_schema": {"$ref": "#/$defs/nowhere"}},
    "remote-ref": {"json_schema": {"$ref": "http://127.0.0.1:9/schema.json"}},
    "huge-schema": {
        "json_schema": {
            "type": "object",
            "properties": {f"field_{i}": {"type": "integer"} for i in range(3000)},
        }
    },
    "deep-schema": {"json_schema": _deep_schema(300)},
    "huge-repeat-regex": {"regex": "a{100000}"},
    "nested-repeat-regex": {"regex": "((a{1,50}){1,50}){1,50}"},
    "empty-regex": {"regex": ""},
    "impossible-schema": {"json_schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}},
    "huge-enum": {"json_schema": {"enum": [f"value-{i}" for i in range(20000)]}},
}


@pytest.mark.parametrize("name", sorted(BAD_GRAMMARS))
def test_invalid_grammar_is_4xx(server: LiveServer, name: str) -> None:
    body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 8, **BAD_GRAMMARS[name]}}
    assert_4xx(server.post("/generate", body, timeout=30))


@pytest.mark.parametrize("name", sorted(HOSTILE_GRAMMARS))
def test_hostile_grammar_is_bounded(server: LiveServer, name: str) -> None:
    body = {
        "text": "Answer:",
        "sampling_params": {"max_new_tokens": 8, **GREEDY, **HOSTILE_GRAMMARS[name]},
    }
    t0 = time.monotonic()
    assert_ok_or_4xx(server.post("/generate", body, timeout=40))
    assert time.monotonic() - t0 < 30


def test_invalid_grammar_on_openai_routes(server: LiveServer) -> None:
    failures = Failures()
    chat = {"model": "default", "max_tokens": 4, **openai_prompt("chat")}
    formats = [
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        {"type": "xml"},
        "json",
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}},
        },
    ]
    for fmt in formats:
        failures.check(
            fmt,
            lambda b={**chat, "response_format": fmt}: assert_4xx(
                server.post("/v1/chat/completions", b, timeout=30)
            ),
        )
    comp = {"model": "default", "max_tokens": 4, "prompt": "x"}
    for extra in [{"regex": "("}, {"json_schema": "{"}, {"ebnf": "::="}]:
        failures.check(
            extra,
            lambda b={**comp, **extra}: assert_4xx(server.post("/v1/completions", b, timeout=30)),
        )
    failures.assert_none()


# ---------------------------------------------------------------------- payload limits
def _poll_health(server: LiveServer, stop: threading.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            ok = httpx.get(server.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            ok = False
        latencies.append(time.monotonic() - t0 if ok else float("inf"))
        time.sleep(0.05)


# JSON decoding and model validation hold the GIL for a body this size (about 0.5 s for 8 MB on
# a loaded 2-core machine); the bound catches work that scales with the prompt (tokenizing a
# 50 MB prompt on the event loop stalled every route for 38 s).
HEALTH_STALL_S = 3.0
BIG_BODIES = {
    "text-8mb": lambda: orjson.dumps({"text": "hello world " * 700_000}),
    "ids-8mb": lambda: orjson.dumps({"input_ids": [1000] * 1_600_000}),
    "chat-8mb": lambda: orjson.dumps(
        {
            "model": "default",
            "messages": [{"role": "user", "content": "hi "} for _ in range(200_000)],
        }
    ),
    "stop-8mb": lambda: orjson.dumps(
        {"text": "hi", "sampling_params": {"stop": ["abcdefgh"] * 700_000}}
    ),
}


@pytest.mark.parametrize("name", sorted(BIG_BODIES))
def test_multi_mb_body_is_refused_and_health_stays_up(server: LiveServer, name: str) -> None:
    raw = BIG_BODIES[name]()
    assert len(raw) > 2_000_000
    path = "/v1/chat/completions" if name.startswith("chat") else "/generate"
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_poll_health, args=(server, stop, latencies))
    poller.start()
    try:
        r = server.post(path, raw=raw, timeout=60)
    finally:
        stop.set()
        poller.join()
    assert_openai_error(r, (400, 413))
    # tokenization runs off the event loop: /health answers meanwhile
    assert max(latencies, default=0) < HEALTH_STALL_S, (
        f"/health stalled while the body was processed: {[round(x, 2) for x in latencies]}"
    )


# ---------------------------------------------------------------------- OpenAI fields, models
UNKNOWN_FIELDS = {
    "user": "someone",
    "store": False,
    "metadata": {"a": "b"},
    "service_tier": "auto",
    "parallel_tool_calls": True,
    "some_future_field": [1],
    "prediction": {"type": "content", "content": "x"},
    "modalities": ["text"],
}


def test_unknown_openai_fields_are_ignored(server: LiveServer) -> None:
    chat = {
        "model": "default",
        "max_tokens": 3,
        **GREEDY,
        **UNKNOWN_FIELDS,
        "messages": [{"role": "user", "content": "hi", "unknown_part": 1}],
    }
    base = server.post(
        "/v1/chat/completions",
        {
            "model": "default",
            "max_tokens": 3,
            **GREEDY,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    r = server.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == base.json()["choices"][0]["message"]
    comp = {
        "model": "default",
        "prompt": "hi",
        "max_tokens": 3,
        **GREEDY,
        **UNKNOWN_FIELDS,
        "best_of": 1,
        "suffix": None,
    }
    r = server.post("/v1/completions", comp)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_model_name_missing_vs_unknown(server: LiveServer, route: str) -> None:
    body = {"max_tokens": 2, **openai_prompt(route)}
    for missing in (body, {**body, "model": None}):
        r = server.post(route, missing)
        if r.status_code != 200:  # OpenAI refuses a missing model; vLLM and SGLang serve it
            assert assert_openai_error(r)["param"] == "model", r.text
    err = assert_openai_error(server.post(route, {**body, "model": "gpt-unknown"}), (404,))
    assert err["code"] == "model_not_found" and err["param"] == "model", err
    assert_openai_error(server.post(route, {**body, "model": 123}), (400,))
    assert server.post(route, {**body, "model": "default"}).status_code == 200
    served = server.get("/v1/models").json()["data"][0]["id"]
    assert server.post(route, {**body, "model": served}).status_code == 200
    assert_openai_error(server.get("/v1/models/gpt-unknown"), (404,))


# ---------------------------------------------------------------------- API key
def _walk_routes(routes: list, prefix: str = "") -> list[tuple[str, str]]:
    from starlette.routing import Route

    out = []
    for route in routes:
        inner = getattr(route, "original_router", None) or getattr(route, "app", None)
        if isinstance(route, Route):
            path = re.sub(r"\{[^}]+\}", "x", prefix + route.path)
            out += [(m, path) for m in sorted(route.methods or ()) if m != "HEAD"]
        elif getattr(inner, "routes", None) is not None:  # an included router or a mount
            ctx = getattr(route, "include_context", None)
            out += _walk_routes(inner.routes, prefix + (getattr(ctx, "prefix", "") or ""))
    return out


def app_routes(keyed: LiveServer) -> list[tuple[str, str]]:
    """(method, path) of every route of the server's FastAPI app, built in-process."""
    from radixlm.srt.config import ServerConfig
    from radixlm.srt.managers.scheduler_process import IpcEndpoints
    from radixlm.srt.managers.tokenizer_manager import TokenizerManager
    from radixlm.srt.server.app import create_app

    with tempfile.TemporaryDirectory() as ipc:
        tm = TokenizerManager(ServerConfig(api_key=API_KEY), None, IpcEndpoints.in_dir(ipc))
        tm.info = keyed.info()
        routes = _walk_routes(create_app(tm).routes)
        asyncio.run(tm.close())
    return sorted(set(routes))


def test_api_key_on_every_route(keyed: LiveServer) -> None:
    from radixlm.srt.server.app import OPEN_PATHS

    routes = app_routes(keyed)
    assert ("POST", "/generate") in routes and ("POST", "/v1/chat/completions") in routes
    wrong = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": f"Bearer {API_KEY}x"},
        {"Authorization": f"Bearer {API_KEY[:-1]}"},
        {"X-API-Key": API_KEY},
    ]
    failures = Failures()
    for method, path in routes:
        if path in OPEN_PATHS:
            continue
        for headers in wrong:
            failures.check((method, path, headers), _assert_401, keyed, method, path, headers)
    for path in [
        "/generate/",
        "//generate",
        "/GENERATE",
        "/generate?x=/health",
        "/health/../generate",
        "/v1/models/../../flush_cache",
        "/%67enerate",
    ]:
        failures.check(("path trick", path), _assert_not_served, keyed, path)
    failures.assert_none()
    for path in OPEN_PATHS:
        assert httpx.get(keyed.url + path, timeout=10).status_code in (200, 404), path
    good = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(keyed.url + "/v1/models", headers=good, timeout=10).status_code == 200
    r = httpx.post(
        keyed.url + "/generate",
        headers=good,
        timeout=30,
        json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
    )
    assert r.status_code == 200, r.text


def _assert_401(server: LiveServer, method: str, path: str, headers: dict) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    r = httpx.request(
        method,
        server.url + path,
        headers=headers,
        timeout=10,
        json=body if method == "POST" else None,
    )
    assert_openai_error(r, (401,))


def _assert_not_served(server: LiveServer, path: str) -> None:
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), 10) as s:
        body = b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}'
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        head = read_until(s, b"\r\n\r\n", 10).split(b"\r\n", 1)[0]
    status = int(head.split()[1]) if head.startswith(b"HTTP/") else 0
    assert status in (400, 401, 404, 405), f"{path!r} answered {head!r} without the key"


# ---------------------------------------------------------------------- disconnect and abort
def _phase_body(phase: str, rid: str) -> dict:
    """A native request that stays in ``phase`` for a while."""
    sp: dict = {"max_new_tokens": 400 if phase != "prefill" else 1, "ignore_eos": True}
    body: dict = {"rid": rid, "stream": phase == "streaming", "sampling_params": sp}
    if phase == "prefill":
        body["input_ids"] = ids_prompt(CONTEXT - 2, 3000 + random.randrange(5000))
    else:
        body["text"] = f"Tell me a long story about {rid}."
    if phase == "grammar":  # a fresh (uncached) schema that takes a while to compile
        sp["json_schema"] = {
            "type": "object",
            "properties": {
                f"{rid}_{i}": {"type": "string", "pattern": "[a-z]{1,20}"} for i in range(400)
            },
        }
    if phase == "queued":  # waits behind the pool: the whole pool for prompt + output
        sp["max_new_tokens"] = CONTEXT - 20
    return body


def _hold_pool(server: LiveServer, tag: str) -> list[Future]:
    """Fills the pool with long requests so the next one waits (the 'before the first token'
    phase); they are aborted by the caller."""
    pool = ThreadPoolExecutor(8)
    futs = [
        pool.submit(
            server.post,
            "/generate",
            {
                "rid": f"{tag}-holder-{i}",
                "input_ids": ids_prompt(200, 4000 + 300 * i),
                "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
            },
            timeout=60,
        )
        for i in range(POOL // 500 + 1)
    ]
    pool.shutdown(wait=False)
    return futs


PHASES = ["queued", "prefill", "streaming", "grammar"]


@pytest.mark.parametrize("phase", PHASES)
def test_disconnect_in_every_phase(server: LiveServer, phase: str) -> None:
    rid = f"disc-{phase}-{uuid.uuid4().hex[:8]}"
    holders = _hold_pool(server, rid) if phase == "queued" else []
    time.sleep(0.3 if holders else 0)
    sock = raw_request(server, "/generate", orjson.dumps(_phase_body(phase, rid)))
    if phase == "streaming":
        assert b"data: " in read_until(sock, b"data: ", 20)
    else:
        time.sleep(0.15)
    sock.close()
    for i in range(len(holders)):
        server.post("/abort_request", {"rid": f"{rid}-holder-{i}"}, timeout=10)
    for f in holders:
        assert_ok_or_abort(f.result(timeout=60))


@pytest.mark.parametrize("phase", PHASES)
def test_abort_in_every_phase(server: LiveServer, phase: str) -> None:
    rid = f"abort-{phase}-{uuid.uuid4().hex[:8]}"
    holders = _hold_pool(server, rid) if phase == "queued" else []
    time.sleep(0.3 if holders else 0)
    with ThreadPoolExecutor(1) as pool:
        body = _phase_body(phase, rid)
        fut = pool.submit(
            stream if body["stream"] else server.post,
            *((server, "/generate", body) if body["stream"] else ("/generate", body)),
        )
        time.sleep(0.5 if phase == "streaming" else 0.15)
        r = server.post("/abort_request", {"rid": rid})
        assert r.status_code == 200, r.text
        out = fut.result(timeout=30)
    for i in range(len(holders)):
        server.post("/abort_request", {"rid": f"{rid}-holder-{i}"}, timeout=10)
    for f in holders:
        assert_ok_or_abort(f.result(timeout=60))
    if phase == "streaming":
        resp, events = out
        assert resp.status_code == 200 and events[-2]["meta_info"]["finish_reason"]["type"] in (
            "abort",
        ), events[-2]
    else:
        assert_ok_or_abort(out)


def assert_ok_or_abort(r: httpx.Response) -> None:
    """An aborted native request: 200 with finish_reason abort (SGLang), or a 4xx object;
    a request that won the race finished normally."""
    if r.status_code == 200:
        assert r.json()["meta_info"]["finish_reason"]["type"] in ("abort", "length", "stop")
    else:
        assert_4xx(r)


def test_abort_rid_is_exact(server: LiveServer) -> None:
    """Aborting rid ``job-1`` must not abort ``job-10`` or ``job-1x``."""
    tag = uuid.uuid4().hex[:6]
    rids = [f"{tag}-job-1", f"{tag}-job-10", f"{tag}-job-1x"]
    body = {
        "text": "Count slowly:",
        "sampling_params": {"max_new_tokens": 60, "ignore_eos": True, **GREEDY},
    }
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(server.post, "/generate", {**body, "rid": r}) for r in rids]
        time.sleep(0.3)
        server.post("/abort_request", {"rid": rids[0]})
        outs = [f.result(timeout=60) for f in futs]
    reasons = [
        o.json()["meta_info"]["finish_reason"]["type"] if o.status_code == 200 else o.status_code
        for o in outs
    ]
    assert reasons[1:] == ["length", "length"], reasons


def test_duplicate_rid_while_running(server: LiveServer) -> None:
    rid = f"dup-{uuid.uuid4().hex[:8]}"
    body = {
        "rid": rid,
        "text": "Go on:",
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, **GREEDY},
    }
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(server.post, "/generate", body)
        # the second request must arrive while the first is decoding (on a quiet machine 80
        # tokens of the tiny model took less than the 0.3 s this test used to wait)
        assert wait_for(lambda: server.info()["kv_pool"]["num_running"] == 1, 30, 0.005)
        second = server.post("/generate", body)
        assert_openai_error(second)
        r = first.result(timeout=120)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 400, r.text


def test_flush_cache_while_running_is_refused_cleanly(server: LiveServer) -> None:
    body = {"text": "Keep going:", "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(server.post, "/generate", body)
        time.sleep(0.3)
        r = server.post("/flush_cache", {})
        assert r.status_code == 200 or assert_openai_error(r)
        assert fut.result(timeout=60).status_code == 200
    assert server.post("/flush_cache", {}).status_code == 200


# ---------------------------------------------------------------------- abort storm
def _storm_one(server: LiveServer, k: int, plan: tuple[str, float], tag: str) -> Any:
    how, delay = plan
    rid = f"{tag}-{k}"
    body = {
        "rid": rid,
        "text": f"Storm request number {k % 9}",
        "stream": k % 2 == 0,
        "sampling_params": {
            "max_new_tokens": 16 if how == "keep" else 120,
            "ignore_eos": True,
            **GREEDY,
        },
    }
    if how == "disconnect":
        sock = raw_request(server, "/generate", orjson.dumps(body))
        time.sleep(delay)
        sock.close()
        return None
    if how == "abort":
        threading.Timer(delay, server.post, ("/abort_request", {"rid": rid})).start()
    if body["stream"]:
        r, events = stream(server, "/generate", body, timeout=60)
        assert r.status_code == 200, r.text
        return events[-2]
    r = server.post("/generate", body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_abort_storm(server: LiveServer) -> None:
    rng = random.Random(1234)
    tag = f"storm-{uuid.uuid4().hex[:6]}"
    plans = [
        (rng.choice(["keep", "abort", "abort", "disconnect"]), rng.uniform(0.0, 1.5))
        for _ in range(32)
    ]
    ref_body = {"sampling_params": {"max_new_tokens": 16, "ignore_eos": True, **GREEDY}}
    serial = {
        j: server.post("/generate", {**ref_body, "text": f"Storm request number {j}"}).json()[
            "output_ids"
        ]
        for j in range(9)
    }
    with ThreadPoolExecutor(len(plans)) as pool:
        futs = [pool.submit(_storm_one, server, k, p, tag) for k, p in enumerate(plans)]
        outs = [f.result(timeout=90) for f in futs]
    for k, ((how, _), out) in enumerate(zip(plans, outs, strict=True)):
        if how == "keep":
            assert out["output_ids"] == serial[k % 9], k
        elif how == "abort":
            assert out["meta_info"]["finish_reason"]["type"] in ("abort", "length"), out
    assert gen(server, max_new_tokens=2).status_code == 200


# ---------------------------------------------------------------------- concurrency
CONCURRENT_KINDS = [
    "native",
    "native-stream",
    "completions",
    "completions-stream",
    "chat",
    "chat-stream",
]


def _mixed_call(server: LiveServer, kind: str, prompt: str) -> str:
    base = kind.removesuffix("-stream")
    path = {
        "native": "/generate",
        "completions": "/v1/completions",
        "chat": "/v1/chat/completions",
    }[base]
    if base == "native":
        body: dict = {"text": prompt, "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    else:
        body = {"model": "default", "max_tokens": 6, **GREEDY, **openai_prompt(path, prompt)}
    if kind.endswith("-stream"):
        body["stream"] = True
        r, events = stream(server, path, body, timeout=120)
        assert r.status_code == 200, r.text
        return stream_text(path, events)
    r = server.post(path, body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    if base == "native":
        return out["text"]
    choice = out["choices"][0]
    return choice["message"]["content"] if base == "chat" else choice["text"]


def test_concurrent_mixed_requests_match_serial(server: LiveServer) -> None:
    prompts = [f"Item {i}: the {['cat', 'sky', 'sea', 'code'][i % 4]} is" for i in range(8)]
    calls = [(CONCURRENT_KINDS[k % 6], prompts[(k // 6) % 8]) for k in range(144)]
    serial = {c: _mixed_call(server, *c) for c in sorted(set(calls))}
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda c: _mixed_call(server, *c), calls))
    wrong = [(c, r, serial[c]) for c, r in zip(calls, results, strict=True) if r != serial[c]]
    assert not wrong, f"{len(wrong)} of {len(calls)} differ from the serial run: {wrong[:5]}"
    for p in prompts:  # both routes run the same greedy decode of the same tokens
        assert serial[("completions", p)] == serial[("native", p)], p


# ---------------------------------------------------------------------- stream protocol
@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_stream_protocol(server: LiveServer, route: str) -> None:
    if route == "/generate":
        body: dict = {
            "text": ["One", "Two"],
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "n": 2, **GREEDY},
        }
    else:
        body = {
            "model": "default",
            "max_tokens": 5,
            "n": 2,
            "stream": True,
            **GREEDY,
            "stream_options": {"include_usage": True},
            **openai_prompt(route),
        }
    r, events = stream(server, route, body)
    assert r.status_code == 200, r.text
    data = events[:-1]
    assert all(isinstance(e, dict) and "error" not in e for e in data), data
    if route == "/generate":
        finals = [e for e in data if e["meta_info"]["finish_reason"] is not None]
        assert sorted(e["index"] for e in finals) == [0, 1, 2, 3]
    else:
        finished = [c["index"] for e in data for c in e["choices"] if c["finish_reason"]]
        assert sorted(finished) == [0, 1]
        assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_stream_error_is_an_error_event(server: LiveServer, route: str) -> None:
    """A request that fails after its stream may have started (its grammar does not compile):
    a 4xx before the stream, or an error event followed by [DONE]; never a 5xx or a cut."""
    bad = {"regex": "(unclosed"}
    if route == "/generate":
        body: dict = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4, **bad}}
    else:
        body = {"model": "default", "max_tokens": 4, "stream": True, **bad, **openai_prompt(route)}
    r, events = stream(server, route, body)
    if r.status_code != 200:
        assert_4xx(r)
        return
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["message"], events
    assert 400 <= int(errors[0]["error"]["code"]) < 500, errors


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_stream_aborted_mid_way(server: LiveServer, route: str) -> None:
    """An OpenAI stream whose request is aborted by the server side ends with an error event
    (or a final chunk) and [DONE], never a cut connection."""
    rid = f"oai-abort-{uuid.uuid4().hex[:8]}"
    body = {
        "model": "default",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "rid": rid,
        **openai_prompt(route),
    }
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(stream, server, route, body)
        time.sleep(0.5)
        server.post("/abort_request", {"rid": rid})
        r, events = fut.result(timeout=30)
    assert r.status_code == 200, r.text
    last = events[-2]
    assert "error" in last or last["choices"][0]["finish_reason"] not in (None, "length"), (
        f"the abort did not end the stream: {last}"
    )
