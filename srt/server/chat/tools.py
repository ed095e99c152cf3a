"""Tools and reasoning on the chat route, request side.

``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and the tool messages of the history are
checked (every refusal is a 400 naming the field) and normalised into :class:`ChatParsing`,
which also names the model's tool-call parser and reasoning parser (srt/parsers). From it come
the prompt layout (the parser's ``render``) and the grammar fragment merged into the native
sampling params. chat/tool_stream.py reads the outputs back with the same parsers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from radixlm.grammar.limits import DEFAULT_MAX_JSON_DEPTH, check_spec, json_nesting_depth
from radixlm.grammar.schema_checks import unresolved_ref
from radixlm.srt.managers.tokenizer_manager import GenerateError, TokenizerManager
from radixlm.srt.parsers.harmony import MARKERS, HarmonyParser, HarmonyReasoningParser
from radixlm.srt.parsers.reasoning import ReasoningParser, starts_in_reasoning_for
from radixlm.srt.parsers.registry import (
    make_reasoning_parser,
    make_tool_parser,
    reasoning_needs_markers,
    resolve_tool_parser,
)
from radixlm.srt.parsers.tool_base import ToolCallParser, ToolSpec, forces_calls
from radixlm.srt.server.chat.prompt import PromptLayout, check_no_special_text, plain_layout
from radixlm.srt.server.chat.request import ChatCompletionRequest, ChatMessage, ToolDef
from radixlm.srt.server.http.body import check_tool_count

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_CHOICES = ("none", "auto", "required")
# apply_chat_template's own arguments: chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _bad(message: str, param: str) -> GenerateError:
    return GenerateError(message, 400, param)


# ---------------------------------------------------------------------- request
def _check_parameters(schema: dict[str, Any], param: str) -> None:
    """The arguments' schema is a valid JSON schema of an object, within the grammar limits
    (size, nesting) checked first: the schema checker recurses once per level."""
    try:
        check_spec("json_schema", json.dumps(schema))
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise _bad(f"{param} is not a valid JSON schema: {e.message}", param) from None
    except ValueError as e:
        raise _bad(f"{param}: {e}", param) from None
    except RecursionError:
        raise _bad(f"{param} nests too deeply", param) from None
    ref = unresolved_ref(schema)
    if ref is not None:
        raise _bad(
            f"{param} refers to {ref!r}, which is not in the schema; only local references "
            "(#/$defs/..., #, other JSON pointers) that resolve inside it are supported",
            param,
        )
    kind = schema.get("type", "object")
    if kind != "object":
        raise _bad(
            f"{param} must describe the arguments object (type 'object'), got type {kind!r}",
            param,
        )


def tool_specs(tools: list[ToolDef] | None) -> list[ToolSpec]:
    """The request's function tools, checked: their number first (MAX_TOOLS, before any
    per-tool work), then each one's kind, name, uniqueness and parameters schema."""
    try:
        check_tool_count(tools)
    except ValueError as e:
        raise _bad(str(e), "tools") from None
    specs: list[ToolSpec] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or ()):
        param = f"tools[{i}]"
        if tool.type != "function":
            raise _bad(
                f"{param}.type {tool.type!r} is not supported; only 'function' tools are",
                f"{param}.type",
            )
        fn = tool.function
        if not TOOL_NAME.match(fn.name):
            raise _bad(
                f"{param}.function.name {fn.name!r} must be 1 to 64 letters, digits, "
                "underscores or dashes",
                f"{param}.function.name",
            )
        if fn.name in names:
            raise _bad(f"two tools are named {fn.name!r}; tool names must be unique", "tools")
        parameters = fn.parameters or EMPTY_PARAMETERS
        _check_parameters(parameters, f"{param}.function.parameters")
        names.add(fn.name)
        specs.append(ToolSpec(fn.name, fn.description, parameters, bool(fn.strict)))
    return specs


def _named_choice(raw: dict[str, Any]) -> str:
    fn = raw.get("function")
    if raw.get("type") != "function" or not isinstance(fn, dict):
        raise _bad(
            "tool_choice must be 'none', 'auto', 'required', "
            '{"type": "function", "function": {"name": ...}} or ' + ALLOWED_TOOLS_SHAPE,
            "tool_choice",
        )
    name = fn.get("name")
    if not isinstance(name, str):
        raise _bad("tool_choice.function.name must be a string", "tool_choice")
    return name


ALLOWED_TOOLS_SHAPE = (
    '{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": '
    '[{"type": "function", "function": {"name": ...}}, ...]}}'
)


def allowed_tools(
    raw: str | dict[str, Any] | None, specs: list[ToolSpec]
) -> tuple[str | dict[str, Any] | None, list[ToolSpec]]:
    """OpenAI's ``{"type": "allowed_tools", ...}`` choice: its mode and the tools it names
    (the only ones the prompt shows and the model may call); any other choice: as it is, with
    every tool."""
    if not isinstance(raw, dict) or raw.get("type") != "allowed_tools":
        return raw, specs
    spec = raw.get("allowed_tools")
    if set(raw) != {"type", "allowed_tools"} or not isinstance(spec, dict):
        raise _bad(
            f"tool_choice of type allowed_tools must be {ALLOWED_TOOLS_SHAPE}", "tool_choice"
        )
    mode, listed = spec.get("mode"), spec.get("tools")
    if mode not in ("auto", "required"):
        raise _bad(
            f"tool_choice.allowed_tools.mode must be 'auto' or 'required', got {mode!r}",
            "tool_choice.allowed_tools.mode",
        )
    if not isinstance(listed, list) or not listed or set(spec) - {"mode", "tools"}:
        raise _bad(
            f"tool_choice of type allowed_tools must be {ALLOWED_TOOLS_SHAPE}", "tool_choice"
        )
    by_name = {s.name: s for s in specs}
    chosen: dict[str, ToolSpec] = {}  # by name: a long list of repeats stays linear
    for i, item in enumerate(listed):
        param = f"tool_choice.allowed_tools.tools[{i}]"
        name = _named_choice(item) if isinstance(item, dict) else None
        if name not in by_name:
            known = ", ".join(by_name) or "none"
            raise _bad(f"{param} names {name!r}, which is not one of the tools ({known})", param)
        chosen.setdefault(name, by_name[name])
    return mode, list(chosen.values())


def tool_choice(raw: str | dict[str, Any] | None, specs: list[ToolSpec]) -> str:
    """``none`` | ``auto`` | ``required`` | ``function:<name>``; missing: auto with tools, none
    without. ``required`` or a named tool with no tools, or an unknown name, is a 400."""
    if raw is None:
        return "auto" if specs else "none"
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise _bad(
                f"tool_choice {raw!r} is not one of 'none', 'auto', 'required' (or a named "
                "function)",
                "tool_choice",
            )
        if raw == "required" and not specs:
            raise _bad("tool_choice 'required' needs tools; the request has none", "tool_choice")
        return raw
    name = _named_choice(raw)
    if not specs:
        raise _bad(
            f"tool_choice names the tool {name!r} but the request has no tools", "tool_choice"
        )
    if all(s.name != name for s in specs):
        known = ", ".join(s.name for s in specs)
        raise _bad(
            f"tool_choice names {name!r}, which is not one of the tools ({known})", "tool_choice"
        )
    return f"function:{name}"


@dataclass(frozen=True)
class ChatParsing:
    """How one chat request's outputs are read: its tools and choice, the resolved tool-call
    parser name (``none``: the model takes no tools) and the reasoning parser."""

    specs: list[ToolSpec] = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True
    tool_parser: str = "none"
    reasoning_parser: str = "none"
    starts_in_reasoning: bool = False
    separate_reasoning: bool = True  # false: the reasoning stays in content
    names_only: bool = False  # allowed_tools left some tools out: calls name the rest only
    # harmony's markers are special tokens of the tokenizer (gpt-oss's): no grammar writes them
    harmony_special: bool = False

    @property
    def parses_calls(self) -> bool:
        return bool(self.specs) and self.choice != "none" and self.tool_parser != "none"

    @property
    def special_markup(self) -> bool:
        """Whether the outputs' call or reasoning markup may be special tokens that decoding
        must keep (harmony's channels, with either parser)."""
        if self.reasoning_parser != "none" and reasoning_needs_markers(self.reasoning_parser):
            return True
        return self.parses_calls and bool(make_tool_parser(self.tool_parser, []).special_markers)

    def new_tool_parser(self) -> ToolCallParser | None:
        if not self.parses_calls:
            return None
        return make_tool_parser(self.tool_parser, self.specs)

    def renderer(self) -> ToolCallParser | None:
        """The parser whose ``render`` lays tools and tool messages out for the template."""
        if self.tool_parser == "none":
            return None
        return make_tool_parser(self.tool_parser, self.specs)

    def new_reasoning_parser(self) -> ReasoningParser | HarmonyReasoningParser | None:
        if self.reasoning_parser == "none":
            return None
        return make_reasoning_parser(self.reasoning_parser, self.starts_in_reasoning)

    def output_reasoning_parser(self) -> ReasoningParser | HarmonyReasoningParser | None:
        """The parser that splits reasoning out of the reply (none when it stays in content)."""
        return self.new_reasoning_parser() if self.separate_reasoning else None


def check_tools_supported(parsing: ChatParsing) -> None:
    if parsing.specs and parsing.choice != "none" and parsing.tool_parser == "none":
        raise _bad(
            "this server takes no tools (started with --tool-call-parser none); leave tools "
            "out or send tool_choice 'none'",
            "tools",
        )


def _as_native(fragment: dict[str, Any]) -> dict[str, Any]:
    """A parser's fragment as native sampling params (a JSON schema travels as text)."""
    out = dict(fragment)
    if isinstance(out.get("json_schema"), dict):
        out["json_schema"] = json.dumps(out["json_schema"])
    return out


def output_constraint(
    parsing: ChatParsing,
    response_schema: dict[str, Any] | None,
    response_tag: dict[str, Any] | None,
) -> dict[str, Any]:
    """The grammar fragment of the native sampling params: the tool parser's constraint
    (composed with the response_format schema), else the response_format's own; inside a
    reasoning parser's wrapping, so the grammar starts after the reasoning. Harmony's parsers
    add nothing where its markers are special tokens (``harmony_special``): forced choices are
    refused before (``check_forced_markers``), strict tools under ``"auto"`` are not enforced,
    and a response format constrains the reply as written."""
    fragment: dict[str, Any] | None = None
    if parsing.parses_calls:
        if response_tag is not None:
            raise _bad(
                "response_format structural_tag cannot be combined with tools; send "
                "tool_choice 'none' or leave one out",
                "response_format",
            )
        parser = make_tool_parser(parsing.tool_parser, parsing.specs)
        if not (parsing.harmony_special and isinstance(parser, HarmonyParser)):
            fragment = parser.constraint(
                parsing.specs, parsing.choice, parsing.parallel, response_schema, parsing.names_only
            )
    if fragment is None and response_schema is not None:
        fragment = {"json_schema": response_schema}
    if fragment is None and response_tag is not None:
        fragment = {"structural_tag": response_tag}
    if fragment is None:
        return {}
    reasoning = _wrapping_reasoning_parser(parsing)
    if reasoning is not None:
        fragment = reasoning.wrap_constraint(fragment)
    return _as_native(fragment)


def _wrapping_reasoning_parser(
    parsing: ChatParsing,
) -> ReasoningParser | HarmonyReasoningParser | None:
    """The reasoning parser whose ``wrap_constraint`` places a grammar; none for harmony where
    its markers are special tokens (the grammar then applies to the whole reply, which the
    model writes without channels: harmony's parsers read such text as content)."""
    reasoning = parsing.new_reasoning_parser()
    if isinstance(reasoning, HarmonyReasoningParser) and parsing.harmony_special:
        return None
    return reasoning


def reasoning_wrapped(parsing: ChatParsing, raw: dict[str, Any]) -> dict[str, Any]:
    """A raw grammar param (``regex``, ``ebnf`` or ``json_schema`` sent as such) applied after
    the reasoning block when a reasoning parser is on; ``{}`` (the param stays as sent) when
    none is, or when several are set (the sampling params refuse that themselves)."""
    reasoning = _wrapping_reasoning_parser(parsing)
    if reasoning is None or len(raw) != 1:
        return {}
    try:
        return _as_native(reasoning.wrap_constraint(dict(raw)))
    except ValueError as e:  # json_schema text that is not JSON
        name = next(iter(raw))
        raise _bad(f"{name} cannot be read: {e}", name) from None


# ---------------------------------------------------------------------- history and prompt
def check_tool_messages(messages: list[ChatMessage]) -> None:
    """Only assistant messages make calls; each tool message answers an earlier call by id."""
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise _bad(
                f"messages[{i}] has tool_calls but role {m.role!r}; only assistant messages "
                "make tool calls",
                f"messages[{i}].tool_calls",
            )
        for j, call in enumerate(m.tool_calls or ()):
            _check_history_arguments(call.function.arguments, f"messages[{i}].tool_calls[{j}]")
        call_ids.update(c.id for c in m.tool_calls or ())
        if m.role != "tool":
            continue
        param = f"messages[{i}].tool_call_id"
        if m.tool_call_id is None:
            raise _bad(f"{param} is required: a tool message answers one tool call", param)
        if m.tool_call_id not in call_ids:
            raise _bad(
                f"{param} {m.tool_call_id!r} answers no tool call of an earlier assistant message",
                param,
            )


def _check_history_arguments(arguments: str, param: str) -> None:
    """An earlier call's arguments are laid out for the template as an object, so they are
    bounded like a schema: at most the grammar's JSON nesting depth."""
    depth = json_nesting_depth(arguments)
    if depth > DEFAULT_MAX_JSON_DEPTH:
        raise _bad(
            f"{param}.function.arguments nests {depth} levels deep; at most "
            f"{DEFAULT_MAX_JSON_DEPTH} are allowed",
            f"{param}.function.arguments",
        )


def _has_tool_history(messages: list[ChatMessage]) -> bool:
    return any(m.tool_calls or m.role == "tool" for m in messages)


def tool_texts(specs: list[ToolSpec]) -> list[tuple[str, str]]:
    """The tools' client text the template lays out, by field."""
    out = []
    for i, spec in enumerate(specs):
        if spec.description:
            out.append((f"tools[{i}].function.description", spec.description))
        out.append((f"tools[{i}].function.parameters", json.dumps(spec.parameters)))
    return out


def parallel_calls(sent: bool | None, choice: str) -> bool:
    """Whether a reply may hold several calls: as sent; when not sent, yes except under a named
    tool_choice, which then makes exactly one call of that tool (as vLLM does: clients that
    name a tool, such as instructor's and LangChain's structured output, read one call, and a
    small model would otherwise repeat the call until its token limit). An explicit
    ``parallel_tool_calls: true`` lets a named choice make several calls of its tool."""
    if sent is not None:
        return sent
    return not choice.startswith("function:")


def chat_parsing(req: ChatCompletionRequest, tm: TokenizerManager) -> ChatParsing:
    """The request's tools, choice and history checked; the server's parsers resolved."""
    specs = tool_specs(req.tools)
    check_no_special_text(tm, tool_texts(specs))
    offered = len(specs)
    raw_choice, specs = allowed_tools(req.tool_choice, specs)
    choice = tool_choice(raw_choice, specs)
    check_tool_messages(req.messages)
    template = getattr(tm.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None  # named templates: no guess
    parsing = ChatParsing(
        specs=specs,
        choice=choice,
        parallel=parallel_calls(req.parallel_tool_calls, choice),
        tool_parser=resolve_tool_parser(tm.cfg.tool_call_parser, template),
        reasoning_parser=tm.cfg.reasoning_parser,
        separate_reasoning=req.separate_reasoning,
        names_only=len(specs) < offered,  # the other tools must not be called either
    )
    if reads_harmony(parsing):
        special = set(getattr(tm.tokenizer, "all_special_tokens", None) or ())
        parsing = replace(parsing, harmony_special=bool(special.intersection(MARKERS)))
    check_tools_supported(parsing)
    check_forced_markers(parsing, tm.tokenizer)
    return parsing


def check_forced_markers(parsing: ChatParsing, tokenizer: Any) -> None:
    """A choice that forces calls starts the grammar with the format's call marker; where the
    tokenizer makes that marker a special token (Mistral's ``[TOOL_CALLS]``) no grammar can
    write it: a 400 naming the cause, not a grammar that cannot compile."""
    if not (parsing.parses_calls and forces_calls(parsing.choice)):
        return
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    markers = make_tool_parser(parsing.tool_parser, []).special_markers
    clash = [m for m in markers if m in special]
    if clash:
        raise _bad(
            f"tool_choice {parsing.choice!r} cannot be enforced for this model: its call "
            f"marker {clash[0]} is a special token, which the output grammar cannot write; "
            "send tool_choice 'auto'",
            "tool_choice",
        )


def prompt_layout(parsing: ChatParsing, messages: list[ChatMessage]) -> PromptLayout:
    """The tool parser's ``render`` when there are tools or tool messages; else the messages
    go to the template as they are."""
    renderer = parsing.renderer()
    if renderer is None or not (parsing.specs or _has_tool_history(messages)):
        return plain_layout
    return lambda dicts: renderer.render(dicts, parsing.specs, parsing.choice)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# gpt-oss's template (harmony) writes "Reasoning: <effort>" and knows three efforts
HARMONY_EFFORTS = {
    "none": "low",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}


def reads_harmony(parsing: ChatParsing) -> bool:
    """Whether the model writes harmony (gpt-oss): its parsers are configured or detected."""
    if parsing.tool_parser == HarmonyParser.name:
        return True
    return parsing.reasoning_parser != "none" and reasoning_needs_markers(parsing.reasoning_parser)


def template_kwargs(req: ChatCompletionRequest, harmony: bool = False) -> dict[str, Any]:
    """``chat_template_kwargs`` (such as ``enable_thinking``), minus the template's own
    arguments, which the server sets; ``reasoning_effort`` ``"none"`` sets ``enable_thinking:
    false`` (templates that think by default, such as Qwen3's, read it) unless the kwargs set
    it; the other efforts leave the template's default. ``harmony`` (gpt-oss, whose template
    reads ``reasoning_effort``): the effort goes to the template as low, medium or high (none
    and minimal are low, xhigh and max high). ``continue_final_message`` (vLLM,
    SGLang) renders the last assistant message open, so the reply continues it;
    ``add_generation_prompt: false`` (vLLM) renders no assistant header."""
    kwargs = dict(req.chat_template_kwargs or {})
    taken = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if taken:
        raise _bad(
            f"chat_template_kwargs may not set {', '.join(taken)}; the server sets them",
            "chat_template_kwargs",
        )
    effort = req.reasoning_effort
    if effort is not None and effort not in REASONING_EFFORTS:
        raise _bad(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
            "reasoning_effort",
        )
    if effort == "none":
        kwargs.setdefault("enable_thinking", False)
    if effort is not None and harmony:  # gpt-oss's template reads reasoning_effort itself
        kwargs.setdefault("reasoning_effort", HARMONY_EFFORTS[effort])
    if req.add_generation_prompt is False:  # default: chat/prompt.render opens the reply
        kwargs["add_generation_prompt"] = False
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise _bad(
                "continue_final_message continues the last message and add_generation_prompt "
                "opens a new one; send add_generation_prompt false (or leave it out)",
                "add_generation_prompt",
            )
        if req.messages[-1].role != "assistant":
            raise _bad(
                "continue_final_message needs the last message to be the assistant's, got "
                f"{req.messages[-1].role!r}",
                "continue_final_message",
            )
        kwargs.update(add_generation_prompt=False, continue_final_message=True)
    return kwargs


def with_prompt(parsing: ChatParsing, prompt: str) -> ChatParsing:
    """``parsing`` knowing whether the rendered prompt leaves the model inside its reasoning
    (templates that open ``<think>`` themselves)."""
    if parsing.reasoning_parser == "none":
        return parsing
    return replace(parsing, starts_in_reasoning=starts_in_reasoning_for(prompt))
