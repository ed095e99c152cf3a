"""Hostile clients (see conftest.py): out-of-range sampling values, logprob bounds, token ids, the context boundary and the KV pool."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hostile_util import (
    CONTEXT,
    GREEDY,
    SMALL_POOL,
    Failures,
    LiveServer,
    assert_ok_or_4xx,
    assert_openai_error,
    gen,
    ids_prompt,
    openai_prompt,
)

pytestmark = pytest.mark.slow


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
        {"logprob_start_len": 7},  # 6 (the prompt length) is allowed, as SGLang
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
