"""End to end: a tiny random gpt-oss (``GptOssForCausalLM``: sinks, sliding and full layers,
8 experts) over SmolLM2's tokenizer with the harmony markers added and a gpt-oss-style chat
template (format_templates.py), served with ``--tool-call-parser auto`` (which must pick
``gpt-oss`` from the template) and ``--reasoning-parser gpt-oss``. A random model writes harmony
only because the grammar forces it, so every call here shows the constraint and both parsers
working together, streamed and not, and the history going back through the template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from format_templates import format_tokenizer
from tool_util import ASK, SCHEMAS, TOOLS, WEATHER, assert_healthy, strict_client

pytestmark = pytest.mark.slow

HEADER = "<|channel|>commentary to=functions.get_"


def write_tiny_gpt_oss(path, tokenizer):
    """A randomly initialised 2-layer gpt-oss (seed 0) over ``tokenizer``, saved in ``path``."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    GptOssForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory, default_model_dir):
    """The module's own server: no other module serves its model."""
    path = write_tiny_gpt_oss(
        tmp_path_factory.mktemp("tiny-gpt-oss"), format_tokenizer(default_model_dir, "gpt-oss")
    )
    return start_server(
        "--model-path", path, "--max-total-tokens", 4096, "--reasoning-parser", "gpt-oss"
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return strict_client(server.url, timeout=120)


@pytest.fixture(autouse=True)
def _healthy(server):
    yield
    assert_healthy(server.url, timeout=30)


def valid_args(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def one_call(client: openai.OpenAI, tool_choice="required", **options):
    return client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
        **options,
    )


def test_required_forces_a_harmony_call(client: openai.OpenAI) -> None:
    r = one_call(client, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    valid_args(call)
    assert call.id.startswith("call_")
    raw = "".join(t.token for t in choice.logprobs.content)
    assert HEADER in raw and "<|call|>" in raw, raw  # the markup reached the parsers
    reasoning = choice.message.model_extra.get("reasoning_content")
    assert reasoning is None or "<|" not in reasoning


def test_streamed_call_equals_the_whole_one(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    args, names, reasoning = {}, {}, []
    for chunk in one_call(client, named, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        for tc in delta.tool_calls or ():
            if tc.index not in names:
                names[tc.index], args[tc.index] = tc.function.name, ""
            args[tc.index] += tc.function.arguments or ""
    assert list(names.values()) == ["get_weather"]
    whole = one_call(client, named).choices[0].message
    assert json.loads(args[0]) == json.loads(whole.tool_calls[0].function.arguments)
    assert "".join(reasoning) == (whole.model_extra.get("reasoning_content") or "")
    jsonschema.validate(json.loads(args[0]), WEATHER)


def test_parallel_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=True,
        n=6,
        temperature=1.0,
        seed=5,
        max_tokens=300,
    )
    counts = []
    for choice in r.choices:
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            valid_args(call)
        counts.append(len(choice.message.tool_calls))
    assert counts and max(counts) >= 2, counts


def test_response_format_answer_is_final_channel_content(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        temperature=0,
        max_tokens=200,
        reasoning_effort="low",
    )
    message = r.choices[0].message
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(message.content), schema)
    reasoning = message.model_extra.get("reasoning_content")
    assert reasoning is None or "<|" not in reasoning


def test_tool_loop_through_the_template(client: openai.OpenAI) -> None:
    first = one_call(client, {"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.choices[0].message.tool_calls
    args = valid_args(call)
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": f"sunny in {args['city']}"},
    ]
    second, alone = (
        client.chat.completions.create(
            model="default", messages=m, tools=TOOLS, tool_choice="none", max_tokens=8
        )
        for m in (messages, ASK)
    )
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 8
