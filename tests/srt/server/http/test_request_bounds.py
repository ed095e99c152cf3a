"""The cheap bounds every dialect checks before per-item work (pure functions, no server): one
tool limit for every dialect, tool names checked with a set, the parse routes' text cap, the
Messages precheck and the score pre-count."""

from __future__ import annotations

import time

import pytest

from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.scoring import MAX_SCORE_TOKENS, plan_scores, query_core
from radixlm.srt.server.anthropic.messages_input import precheck as messages_precheck
from radixlm.srt.server.chat.request import ToolDef
from radixlm.srt.server.chat.tools import tool_specs
from radixlm.srt.server.http.body import MAX_TOOLS
from radixlm.srt.server.native.parse import precheck_parse
from radixlm.srt.server.openai.protocol import precheck_chat
from radixlm.srt.server.openai.responses_input import precheck as responses_precheck


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"t{i}"}} for i in range(n)]


PRECHECKS = {
    "chat": lambda data: precheck_chat(data, 10**6),
    "responses": lambda data: responses_precheck(data, 10**6),
    "messages": lambda data: messages_precheck(data, 10**6),
    "parse": lambda data: precheck_parse(data, 10**6),
}


@pytest.mark.parametrize("dialect", sorted(PRECHECKS))
def test_one_tool_limit_for_every_dialect(dialect: str) -> None:
    check = PRECHECKS[dialect]
    check({"tools": _tools(MAX_TOOLS)})
    with pytest.raises(ValueError, match=f"tools has {MAX_TOOLS + 1} entries; at most"):
        check({"tools": _tools(MAX_TOOLS + 1)})


def test_tool_specs_checks_the_count_before_any_tool() -> None:
    bad = [ToolDef.model_validate(t) for t in _tools(MAX_TOOLS + 1)]
    bad[0].function.name = "not a valid name"  # never looked at: the count comes first
    with pytest.raises(GenerateError) as e:
        tool_specs(bad)
    assert e.value.param == "tools" and "at most" in e.value.message


def test_duplicate_tool_names_are_found_in_linear_time() -> None:
    tools = [ToolDef.model_validate(t) for t in _tools(MAX_TOOLS - 1)]
    tools.append(ToolDef.model_validate(_tools(1)[0]))  # "t0" again
    with pytest.raises(GenerateError, match="two tools are named 't0'"):
        tool_specs(tools)


def test_parse_text_is_capped_before_parsing() -> None:
    precheck_parse({"text": "x" * 100}, 100)
    with pytest.raises(ValueError, match="text has 101 characters; at most 100"):
        precheck_parse({"text": "x" * 101}, 100)


def test_messages_precheck_counts_messages_and_blocks() -> None:
    block = {"type": "text", "text": "hi"}
    messages_precheck({"messages": [{"role": "user", "content": [block] * 5}]}, 5)
    with pytest.raises(ValueError, match="6 content blocks"):
        messages_precheck(
            {"messages": [{"role": "user", "content": [block] * 5}], "system": [block]}, 5
        )
    with pytest.raises(ValueError, match="messages has 6 entries"):
        messages_precheck({"messages": [{"role": "user", "content": "x"}] * 6}, 5)


def _plan(query: str, items: list[str], max_token_chars: int = 4):
    return plan_scores(query, items, [1], vocab_size=100, max_token_chars=max_token_chars)


def test_score_text_size_is_checked_before_prompts_are_built() -> None:
    items = ["x"] * 1024
    query = "q" * (MAX_SCORE_TOKENS * 4 // 1024 + 1)
    start = time.perf_counter()
    with pytest.raises(GenerateError, match="more than 262144 tokens can spell"):
        _plan(query, items)
    assert time.perf_counter() - start < 0.5


def test_score_query_pre_count() -> None:
    job = _plan("word " * 1000, ["a", "b"], max_token_chars=100)
    job.check_query_tokens(MAX_SCORE_TOKENS // 2)  # slack included: fits
    with pytest.raises(GenerateError) as e:
        job.check_query_tokens(MAX_SCORE_TOKENS // 2 + 100)
    assert e.value.param == "items" and "at least" in e.value.message
    assert query_core("a" * 1000) == "a" * (1000 - 2 * 256)
    assert query_core("short") == ""


def test_rids_and_session_ids_are_bounded_visible_ascii() -> None:
    from pydantic import ValidationError

    from radixlm.srt.server.http.body import MAX_RID_CHARS, check_rid, check_session_id
    from radixlm.srt.server.native.protocol import (
        AbortRequestInput,
        GenerateReqInput,
        GetWeightsByNameInput,
        OpenSessionInput,
        SessionParamsInput,
    )

    assert check_rid("a" * MAX_RID_CHARS) == "a" * MAX_RID_CHARS
    assert check_rid(["job-1", "job:2/x"]) == ["job-1", "job:2/x"]
    for bad in ("", "a" * (MAX_RID_CHARS + 1), "has space", "new\nline", "é", ["ok", "x" * 999]):
        with pytest.raises(ValueError, match="rid must be"):
            check_rid(bad)
    check_session_id("s" * 256)
    with pytest.raises(ValueError, match="session_id must be 1 to 256"):
        check_session_id("s" * 257)
    huge = "r" * 262_144
    cases = [
        (GenerateReqInput, {"text": "hi", "rid": huge}),
        (GenerateReqInput, {"text": ["a", "b"], "rid": ["ok", huge]}),
        (SessionParamsInput, {"id": "s", "rid": huge}),
        (SessionParamsInput, {"id": huge}),
        (OpenSessionInput, {"capacity_of_str_len": 10, "session_id": huge}),
        (AbortRequestInput, {"rid": huge}),
        (GetWeightsByNameInput, {"name": "w", "truncate_size": 10**30}),
        (GetWeightsByNameInput, {"name": "w", "truncate_size": 0}),
        (GetWeightsByNameInput, {"name": "w" * 10_000}),
    ]
    for model, data in cases:
        with pytest.raises(ValidationError):
            model.model_validate(data)
    assert AbortRequestInput.model_validate({"rid": ""}).rid == ""  # "": none, as before
