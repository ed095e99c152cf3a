"""Structured generation over HTTP: `radixlm serve` on the default model (one server for the
module), driven with the official openai client and httpx: response_format json_schema and
json_object, extra_body regex, and invalid grammars answered with 400 (an error event when
streaming) while the server stays healthy."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import plain_http
import pytest

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "is_student": {"type": "boolean"},
    },
    "required": ["name", "age", "is_student"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me a JSON object with a name and an age."}]


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


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        temperature=0,
        max_tokens=48,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        },
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="default",
        messages=ASK,
        temperature=0,
        max_tokens=48,
        stream=True,
        response_format={"type": "json_object"},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict)


def test_extra_body_regex_and_length(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="default",
        prompt="The year the Berlin wall fell: ",
        temperature=0,
        max_tokens=8,
        extra_body={"regex": r"1\d{3}"},
    )
    assert re.fullmatch(r"1\d{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    cut = client.chat.completions.create(
        model="default",
        messages=ASK,
        temperature=0,
        max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    assert cut.choices[0].finish_reason == "length"


# parses (the front door lets it through); the grammar compiler refuses it, mid-stream
BAD_TYPE_SCHEMA = '{"type": "object", "properties": {"a": {"type": "no-such-type"}}}'


def test_invalid_grammars_get_400_and_the_server_stays_healthy(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError, match="Failed to compile regex grammar") as e:
        client.completions.create(
            model="default", prompt="x", max_tokens=4, extra_body={"regex": "[z-a]"}
        )
    assert e.value.param == "regex"  # the 400 names the field the grammar came from
    with pytest.raises(openai.BadRequestError, match="Failed to compile ebnf grammar") as e:
        client.chat.completions.create(
            model="default", messages=ASK, max_tokens=4, extra_body={"ebnf": "start: ("}
        )
    assert e.value.param == "ebnf"
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": json.loads(BAD_TYPE_SCHEMA)},
    }
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="Failed to compile json_schema") as e:
            client.chat.completions.create(
                model="default", messages=ASK, max_tokens=4, response_format=fmt, stream=stream
            )
        assert e.value.param == "response_format"
    r = plain_http.post(
        server.url + "/generate",
        timeout=120,
        json={
            "text": "x",
            "sampling_params": {"max_new_tokens": 4, "regex": "a", "ebnf": 'start: "a"'},
        },
    )
    assert r.status_code == 400 and "at most one" in r.json()["error"]["message"]
    events = []
    with plain_http.stream(
        "POST",
        server.url + "/generate",
        timeout=120,
        json={
            "text": "x",
            "stream": True,
            "sampling_params": {"max_new_tokens": 4, "json_schema": BAD_TYPE_SCHEMA},
        },
    ) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[0])["error"]
    assert error["message"].startswith("Failed to compile json_schema grammar")
    assert error["param"] == "json_schema"
    assert error["code"] == 400 or error["type"] == "invalid_request_error"
    assert plain_http.get(server.url + "/health", timeout=30).status_code == 200
    ok = client.completions.create(
        model="default", prompt="The capital of France is", temperature=0, max_tokens=3
    )
    assert ok.choices[0].text.startswith(" Paris")
