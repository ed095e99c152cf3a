"""End to end over HTTP /generate: every sampling field SGLang's /generate takes is accepted in
one request, stop_regex stops and trims where Python's ``re`` over the decoded output says,
bad values are 400s naming the field, and a stop regex that backtracks exponentially costs
bounded time. One server on the default model for the module."""

from __future__ import annotations

import json
import math
import re
import time

import httpx
import plain_http
import pytest

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "ignore_eos": True}
TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
    "triggers": ["<f>"],
}
EVERY_FIELD = {  # every SGLang SamplingParams API field, non-default where that means anything
    "max_new_tokens": 16,
    "stop": ["\n\n\n"],
    "stop_token_ids": [7],
    "stop_regex": [r"\d{4}\.", "zzzq"],
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.2,
    "repetition_penalty": 1.1,
    "min_new_tokens": 2,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": TAG,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": True,
    "no_stop_trim": True,
    "custom_params": {"thinking_budget": 8, "labels": ["a", "b"], "opts": {"x": 1.5}},
    "stream_interval": 3,
    "logit_bias": {"5": -1.0},
    "sampling_seed": 1234,
}


@pytest.fixture(scope="module")
def server(default_server) -> ServerProcess:
    return default_server


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def generate(server: ServerProcess, sp: dict, text: str = PROMPT, **body) -> httpx.Response:
    payload = {"text": text, "sampling_params": sp, **body}
    return plain_http.post(server.url + "/generate", json=payload, timeout=120)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: ServerProcess, sp: dict) -> list[dict]:
    body = {"text": PROMPT, "sampling_params": sp, "stream": True}
    events = []
    with plain_http.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def first_match(tok, ids: list[int], pattern: str) -> tuple[int, re.Match, str]:
    """Where ``re`` first matches the decoded output, token by token."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        m = re.search(pattern, text)
        if m:
            return n, m, text
    raise AssertionError(f"{pattern!r} never matches")


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> dict:
    """40 greedy tokens without stops, a pattern that matches a word inside them and one that
    matches two words (so its match spans several tokens)."""
    out = ok(generate(server, {"max_new_tokens": 40, **GREEDY}))
    text = out["text"]
    pairs = [m for m in re.finditer(r"([A-Za-z]{3,}) ([A-Za-z]{2,})", text) if m.start() > 8]
    assert pairs, text
    out["pattern"] = r"\b" + re.escape(pairs[0].group(1)) + r"\b"
    out["two_words"] = re.escape(pairs[0].group(1)) + r"\s+" + re.escape(pairs[0].group(2))
    return out


def test_every_sglang_field_in_one_request(server: ServerProcess) -> None:
    out = ok(generate(server, EVERY_FIELD))
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert 2 <= meta["completion_tokens"] <= 16
    events = stream(server, EVERY_FIELD)
    n = events[-1]["meta_info"]["completion_tokens"]
    assert len(events) <= 1 + math.ceil((n - 1) / 3)  # stream_interval 3
    # sampling_seed is seed: the same seed samples the same tokens under either name
    sampled = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    a = ok(generate(server, {**sampled, "sampling_seed": 99}))
    b = ok(generate(server, {**sampled, "seed": 99}))
    assert a["output_ids"] == b["output_ids"]


def test_custom_params_change_nothing(server: ServerProcess, reference: dict) -> None:
    sp = {"max_new_tokens": 40, **GREEDY, "custom_params": {"thinking_budget": 2}}
    assert ok(generate(server, sp))["text"] == reference["text"]


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_stop_regex_stops_where_re_matches(server, tok, reference, no_stop_trim) -> None:
    n, m, decoded = first_match(tok, reference["output_ids"], reference["pattern"])
    sp = {"max_new_tokens": 40, **GREEDY, "no_stop_trim": no_stop_trim}
    out = ok(generate(server, {**sp, "stop_regex": ["zzzq", reference["pattern"]]}))
    assert out["output_ids"] == reference["output_ids"][:n]
    # SGLang reports the pattern that matched, not the text it matched
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": reference["pattern"]}
    assert out["text"] == (decoded if no_stop_trim else decoded[: m.start()])


def test_streamed_stop_regex_never_shows_the_match(server, tok, reference) -> None:
    n, m, decoded = first_match(tok, reference["output_ids"], reference["two_words"])
    sp = {"max_new_tokens": 40, **GREEDY, "stop_regex": reference["two_words"]}
    texts = [e["text"] for e in stream(server, sp)]
    assert texts[-1] == decoded[: m.start()]
    assert all(decoded[: m.start()].startswith(t) for t in texts)


@pytest.mark.parametrize("interval", [1, 4, 1000])
def test_stream_interval_chunks(server: ServerProcess, reference: dict, interval: int) -> None:
    sp = {"max_new_tokens": 12, **GREEDY, "stream_interval": interval}
    events = stream(server, sp)
    assert events[-1]["text"] == ok(generate(server, {"max_new_tokens": 12, **GREEDY}))["text"]
    assert len(events) <= 1 + math.ceil(11 / interval)
    if interval == 1:
        assert len(events) > 2  # an update per token, give or take a coalesced one


@pytest.mark.parametrize(
    "sp, param",
    [
        ({"stop_regex": "(ab"}, "stop_regex"),
        ({"stop_regex": "a*"}, "stop_regex"),
        ({"stop_regex": ["x"] * 17}, "stop_regex"),
        ({"structural_tag": "{not json"}, "structural_tag"),
        ({"structural_tag": TAG, "regex": "a+"}, None),
        ({"custom_params": {"a": [[1]]}}, "custom_params"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"sampling_seed": 1, "seed": 2}, "sampling_seed"),
    ],
)
def test_bad_values_are_400s_naming_the_field(server: ServerProcess, sp: dict, param) -> None:
    r = generate(server, sp)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and isinstance(err["message"], str) and err["message"]


def test_hostile_stop_regex_is_cut_off(server: ServerProcess) -> None:
    """The output is forced to a run of a's, over which ``(a|aa)+c`` backtracks exponentially:
    the request ends with a 400 naming stop_regex in bounded time, the server keeps serving."""
    sp = {"max_new_tokens": 120, **GREEDY, "regex": "a{300}", "stop_regex": "(a|aa)+c"}
    started = time.monotonic()
    r = generate(server, sp)
    assert time.monotonic() - started < 60
    assert r.status_code == 400, r.text
    assert "stop_regex[0] '(a|aa)+c' took too long" in r.json()["error"]["message"]
    assert ok(generate(server, {"max_new_tokens": 2, **GREEDY}))["meta_info"]["completion_tokens"]
