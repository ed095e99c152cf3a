"""Structural tags end to end: the default model (SmolLM2-135M-Instruct) generates through
``Engine`` with ``sampling_params={"structural_tag": ...}``; the outputs are read back with the
reference parser of test_structural_tag and their JSON validated with jsonschema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_structural_tag import (
    TOOL_END,
    TOOL_TAGS,
    TOOLS,
    parse_tool_calls,
    triggered,
)

pytestmark = pytest.mark.slow

SYSTEM = (
    "You can call tools. To call one, write <tool_call>\n"
    '{"name": <tool name>, "arguments": <JSON arguments>}\n</tool_call>. Tools: '
    + json.dumps([{"name": name, "parameters": schema} for name, schema in TOOLS.items()])
)
QUESTIONS = ["What is the weather in Oslo?", "What time is it in Berlin?"]


@pytest.fixture(scope="module")
def engine(smol_engine):
    """The session's default-model Engine (these tests only send requests)."""
    return smol_engine


def _prompt(engine, question: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return engine.apply_chat_template(messages)


def _generate(engine, fmt: dict, max_new_tokens: int, temperature: float) -> list[dict]:
    tag = {"type": "structural_tag", "format": fmt}
    params = {"structural_tag": tag, "max_new_tokens": max_new_tokens, "temperature": temperature}
    prompts = [_prompt(engine, q) for q in QUESTIONS]
    return engine.generate(prompts, sampling_params=[dict(params, seed=i) for i in range(2)])


def _finish(out: dict) -> str:
    reason = out["meta_info"]["finish_reason"]
    return reason["type"] if isinstance(reason, dict) else str(reason)


def test_forced_single_tool_call_is_valid_and_finishes(engine):
    fmt = triggered(at_least_one=True, stop_after_first=True)
    for out in _generate(engine, fmt, max_new_tokens=120, temperature=0.8):
        text = out["text"]
        calls = parse_tool_calls(text)
        assert len(calls) == 1 and calls[0][2] == 0, text
        name, arguments, _, end = calls[0]
        jsonschema.validate(arguments, TOOLS[name])
        assert end == len(text) and text.endswith(TOOL_END), text
        assert _finish(out) == "stop", out["meta_info"]


def test_free_text_with_optional_tool_calls(engine):
    for out in _generate(engine, triggered(), max_new_tokens=64, temperature=1.0):
        text = out["text"]
        if _finish(out) != "stop":  # cut by the token budget: only whole calls are checked
            text = text[: text.rfind(TOOL_END) + len(TOOL_END)] if TOOL_END in text else ""
        for name, arguments, _, _ in parse_tool_calls(text):
            jsonschema.validate(arguments, TOOLS[name])


def test_tags_with_separator_only_tags(engine):
    fmt = {
        "type": "tags_with_separator",
        "tags": TOOL_TAGS,
        "separator": "\n",
        "at_least_one": True,
    }
    for out in _generate(engine, {**fmt, "stop_after_first": True}, 120, temperature=0.7):
        calls = parse_tool_calls(out["text"])
        assert len(calls) == 1 and calls[0][2] == 0 and calls[0][3] == len(out["text"]), out
        jsonschema.validate(calls[0][1], TOOLS[calls[0][0]])


def test_bad_structural_tag_is_refused_at_the_door(engine):
    bad = {"type": "structural_tag", "format": triggered(triggers=["<call"])}
    with pytest.raises(ValueError, match="structural_tag .*starts with none of the triggers"):
        engine.generate("hi", sampling_params={"structural_tag": bad, "max_new_tokens": 4})
