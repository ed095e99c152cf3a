"""SGLang's text-parsing routes: ``/parse_function_call`` and ``/separate_reasoning``.

They run the server's own output parsers over a text a client already has (an output of
``/generate``, say), with no generation:

- ``/parse_function_call`` ``{"text", "tools", "tool_call_parser"}`` ->
  ``{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}``: ``tool_index`` is the
  tool's place in ``tools``, ``parameters`` the arguments' JSON text; calls naming a tool that
  is not in ``tools`` are dropped (as on the chat route). Without ``tool_call_parser`` the
  server's parser is used (``--tool-call-parser``, ``auto`` read from the chat template).
- ``/separate_reasoning`` ``{"text", "reasoning_parser", "return_blocks"}`` ->
  ``{"reasoning_text", "text"}``, plus ``reasoning_blocks`` / ``text_blocks`` / ``blocks``
  when ``return_blocks`` is true.

An unknown parser name is a 400 that lists the known ones; so is a field the route does not take.
Bounds (a 400 before any parsing): ``text`` at most :func:`max_parse_chars` characters (no more
than the context's tokens can spell, and at most MAX_PARSE_CHARS), ``tools`` at most MAX_TOOLS.
The parsers run on the tokenizer pool, off the event loop (they are linear in the text).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, field_validator

from radixlm.srt.managers.tokenizer_manager import GenerateError, TokenizerManager
from radixlm.srt.parsers.registry import (
    make_reasoning_parser,
    make_tool_parser,
    resolve_tool_parser,
)
from radixlm.srt.server.chat.request import ToolDef
from radixlm.srt.server.chat.tool_stream import OfferedCalls
from radixlm.srt.server.chat.tools import ChatParsing, tool_specs
from radixlm.srt.server.http.body import StrictBody, check_rid, check_tool_count
from radixlm.srt.server.http.deps import get_tm, json_response
from radixlm.srt.server.http.errors import parse_body
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, json_body

router = APIRouter(responses=ERROR_RESPONSES)

MAX_PARSE_CHARS = 2**20  # the longest text a parse route reads, whatever the context


def max_parse_chars(tm: TokenizerManager) -> int:
    """A text longer than the context's tokens can spell is no output of this model."""
    return min(tm.max_prompt_chars, MAX_PARSE_CHARS)


def precheck_parse(data: dict[str, Any], max_chars: int) -> None:
    """Sizes before the body is validated: the tools' number, the text's length."""
    check_tool_count(data.get("tools"))
    text = data.get("text")
    if isinstance(text, str) and len(text) > max_chars:
        raise ValueError(f"text has {len(text)} characters; at most {max_chars}")


def _precheck(request: Request) -> Callable[[dict[str, Any]], None]:
    limit = max_parse_chars(get_tm(request))
    return lambda data: precheck_parse(data, limit)


class ParseFunctionCallInput(StrictBody):
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str | None = None  # SGLang's request base; nothing is generated, so nothing to name
    _rid_bounded = field_validator("rid")(classmethod(lambda cls, v: check_rid(v)))
    text: str
    tools: list[ToolDef] = []
    tool_call_parser: str | None = None


class SeparateReasoningInput(StrictBody):
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str | None = None
    _rid_bounded = field_validator("rid")(classmethod(lambda cls, v: check_rid(v)))
    text: str
    reasoning_parser: str
    return_blocks: bool = False


def _tool_parser_name(requested: str | None, request: Request) -> str:
    tm = get_tm(request)
    template = getattr(tm.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    try:
        name = resolve_tool_parser(requested or tm.cfg.tool_call_parser, template)
    except ValueError as e:
        raise GenerateError(str(e), 400, "tool_call_parser") from None
    if name == "none":
        raise GenerateError(
            "no tool-call parser: this server runs with --tool-call-parser none; name one "
            "in tool_call_parser",
            400,
            "tool_call_parser",
        )
    return name


@router.post("/parse_function_call", openapi_extra=json_body(ParseFunctionCallInput))
async def parse_function_call(request: Request) -> Response:
    body = await parse_body(request, ParseFunctionCallInput, None, _precheck(request))
    name = _tool_parser_name(body.tool_call_parser, request)
    specs = tool_specs(body.tools)
    parser = make_tool_parser(name, specs)
    result = await get_tm(request).run_blocking(parser.parse, body.text)
    calls = OfferedCalls(ChatParsing(specs=specs)).calls(result.calls)
    index = {spec.name: i for i, spec in enumerate(specs)}
    return json_response(
        {
            "normal_text": result.content,
            "calls": [
                {"tool_index": index.get(c.name, -1), "name": c.name, "parameters": c.arguments}
                for c in calls
            ],
        }
    )


@router.post("/separate_reasoning", openapi_extra=json_body(SeparateReasoningInput))
async def separate_reasoning(request: Request) -> Response:
    body = await parse_body(request, SeparateReasoningInput, None, _precheck(request))
    try:
        parser = make_reasoning_parser(body.reasoning_parser, False)
    except ValueError as e:
        raise GenerateError(str(e), 400, "reasoning_parser") from None
    reasoning, text = await get_tm(request).run_blocking(parser.split, body.text)
    out: dict = {"reasoning_text": reasoning or "", "text": text}
    if body.return_blocks:
        blocks = [{"type": "reasoning", "text": reasoning}] if reasoning else []
        blocks.append({"type": "text", "text": text})
        out["reasoning_blocks"] = [b["text"] for b in blocks if b["type"] == "reasoning"]
        out["text_blocks"] = [b["text"] for b in blocks if b["type"] == "text"]
        out["blocks"] = blocks
    return json_response(out)
