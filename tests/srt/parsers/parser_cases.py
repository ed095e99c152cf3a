"""Helpers of the parser tests: streaming a text in pieces, and generated call texts whose
expected content and calls are known by construction (the reference)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from radixlm.srt.parsers.json_stream import FAILED, JsonScanner
from radixlm.srt.parsers.registry import make_tool_parser
from radixlm.srt.parsers.tool_base import ParseResult, ToolCall, ToolCallDelta, calls_from_deltas


def stream(parser_name: str, pieces: list[str]) -> tuple[ParseResult, list[ToolCallDelta]]:
    """Feeds the pieces to a fresh parser, then flushes; the result and every delta."""
    parser = make_tool_parser(parser_name, [])
    content, deltas = [], []
    for piece in pieces:
        text, new = parser.feed(piece)
        content.append(text)
        deltas += new
    text, new = parser.flush()
    content.append(text)
    deltas += new
    return ParseResult("".join(content), calls_from_deltas(deltas)), deltas


def random_pieces(text: str, rng: random.Random, most: int = 6) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, most))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def check_deltas(deltas: list[ToolCallDelta]) -> None:
    """Names only on each call's first delta, indexes counting from 0 in order."""
    seen: list[int] = []
    for delta in deltas:
        if delta.index not in seen:
            assert delta.name is not None, delta
            assert delta.index == len(seen), (delta, seen)
            seen.append(delta.index)
        else:
            assert delta.name is None, delta
            assert delta.index == seen[-1], "a call's deltas are contiguous"


def is_object_start(text: str) -> bool:
    """Whether ``text`` is the start of the JSON text of an object (or all of it)."""
    scanner = JsonScanner(object_only=True)
    stop = scanner.scan(text)
    return scanner.status != FAILED and not text[stop:].strip(" \t\n\r")


def check_arguments(calls: list[ToolCall]) -> None:
    """Every call's arguments are a JSON object, except the last call's when the output was
    cut off inside it: then they are the start of one (as written, nothing closed)."""
    for call in calls[:-1]:
        assert isinstance(json.loads(call.arguments), dict), call
    for call in calls[-1:]:
        assert is_object_start(call.arguments), call


def spaced_json(value: object, rng: random.Random) -> str:
    """JSON text of value with random (valid) whitespace between its tokens."""
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
    out, in_string, escaped = [], False, False
    for c in text:
        if in_string:
            out.append(c)
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            continue
        if c == " ":
            c = rng.choice(["", " ", "\n", "\t", "  "])
        elif c in "{[,:" and rng.random() < 0.3:
            c += rng.choice([" ", "\n  ", ""])
        elif c in "}]" and rng.random() < 0.3:
            c = rng.choice(["\n", " "]) + c
        in_string = c.endswith('"')
        out.append(c)
    return "".join(out)


@dataclass
class Case:
    text: str
    content: str
    calls: list[ToolCall]


def call_object(name: str, args_text: str, rng: random.Random, key: str = "arguments") -> str:
    """A call object with random whitespace, key order and argument encoding."""
    ws = lambda: rng.choice(["", " ", "\n", "  "])  # noqa: E731
    name_part = f'"name"{ws()}:{ws()}{json.dumps(name)}'
    if rng.random() < 0.15:  # arguments given as a JSON string holding the object
        args_part = f'"{key}"{ws()}:{ws()}{json.dumps(args_text)}'
    else:
        args_part = f'"{key}"{ws()}:{ws()}{args_text}'
    parts = [name_part, args_part] if rng.random() < 0.8 else [args_part, name_part]
    return "{" + ws() + f"{ws()},{ws()}".join(parts) + ws() + "}"
