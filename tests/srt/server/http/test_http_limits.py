"""Bounds of what one HTTP request can make the server do, over the fake stack: /detokenize
batches, bodies made of millions of tiny arrays (refused before they are parsed), a body cut off
by its client (answered quietly), HEAD probes, and logit_bias keys spelled only one way."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import orjson
import pytest
from fake_stack import CONTEXT_LENGTH, FakeStack

from radixlm.srt.server.http.errors import MAX_JSON_CONTAINERS


def post(stack: FakeStack, path: str, body: object) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=60)


def test_detokenize_batches_are_bounded(idle_stack: FakeStack) -> None:
    ok = post(idle_stack, "/detokenize", {"tokens": [[5, 6]] * 1024})
    assert ok.status_code == 200 and len(ok.json()["text"]) == 1024
    many = post(idle_stack, "/detokenize", {"tokens": [[5]] * 1025})
    assert many.status_code == 400 and many.json()["error"]["param"] == "tokens"
    long_row = post(idle_stack, "/detokenize", {"tokens": [5] * (CONTEXT_LENGTH + 1)})
    assert long_row.status_code == 400 and "at most" in long_row.json()["error"]["message"]
    assert (
        post(idle_stack, "/detokenize", {"tokens": [5, 6]}).json()["text"]
        == post(idle_stack, "/detokenize", {"tokens": [[5, 6]]}).json()["text"][0]
    )


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/detokenize"])
def test_millions_of_tiny_arrays_are_refused_before_parsing(idle_stack, path) -> None:
    body = orjson.dumps({"input_ids": [[1]] * (4 * MAX_JSON_CONTAINERS), "prompt": [[1]]})
    started = time.perf_counter()
    r = httpx.post(
        idle_stack.url + path,
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400 and "JSON arrays or objects" in r.json()["error"]["message"]
    assert time.perf_counter() - started < 5  # parsing it would take seconds of the loop
    assert httpx.get(idle_stack.url + "/health", timeout=5).status_code == 200


def test_a_body_cut_off_by_its_client_is_not_an_error(idle_stack, caplog) -> None:
    caplog.set_level(logging.ERROR)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", idle_stack.port)) as s:
            s.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"te'
            )
    time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert httpx.get(idle_stack.url + "/health", timeout=5).status_code == 200


def test_head_probes(idle_stack: FakeStack) -> None:
    for path in ("/health", "/ready"):
        assert httpx.head(idle_stack.url + path, timeout=5).status_code == 200


@pytest.mark.parametrize("key", [" 1", "+1", "1_0", "\u0661\u0662", "1.0", "0x1"])
def test_logit_bias_keys_are_plain_decimals(idle_stack: FakeStack, key) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": {key: 1.0}}}
    r = post(idle_stack, "/generate", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = post(idle_stack, "/v1/chat/completions", {**chat, "logit_bias": {key: 1.0}})
    assert r.status_code == 400
    assert post(idle_stack, "/v1/chat/completions", {**chat, "logit_bias": {"12": 1.0}}).is_success
