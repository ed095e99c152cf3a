"""Generated outputs of the qwen3_coder, mistral and pythonic formats whose content and calls
are known by construction (the reference), over one tool that has a parameter of each type."""

from __future__ import annotations

import json
import random

from parser_cases import Case, call_object, spaced_json

from radixlm.srt.parsers.tool_base import ToolCall, ToolSpec

TYPED = ToolSpec(
    "typed",
    "A parameter of each type",
    {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
            "o": {"type": "object"},
            "a": {"type": "array"},
            "u": {"type": ["string", "null"]},
        },
    },
)
TOOLS = [TYPED, ToolSpec("get_time")]
_TEXT = "abc XYZ é\"'<>/{}[],=()\\\n\t"


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, 10)))


def _json_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["int", "str", "list", "dict", "bool", "none"] if depth < 2 else ["int"])
    if kind == "int":
        return rng.randint(-99, 99)
    if kind == "str":
        return _text(rng)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_text(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def typed_arguments(rng: random.Random) -> dict:
    """Random arguments of TYPED: a random subset of its parameters, in random order."""
    values = {
        "s": _text(rng).replace("</parameter>", ""),
        "n": rng.randint(-1000, 1000),
        "x": rng.choice([0.5, -2.25, 1e-3, 3.0]),
        "b": rng.random() < 0.5,
        "o": {"k": _json_value(rng), "e": "é"},
        "a": [_json_value(rng) for _ in range(rng.randint(0, 3))],
        "u": rng.choice([None, "plain text", ""]),
    }
    keys = rng.sample(sorted(values), rng.randint(0, len(values)))
    return {k: values[k] for k in keys}


def _lead(rng: random.Random, marker: str) -> tuple[str, str]:
    """(text before the calls, the content it shows)."""
    if rng.random() < 0.4:
        return "", ""
    words = rng.choice(["Let me check.", "Sure: a < b, [x] {y}", "ok"])
    return words + rng.choice(["", " ", "\n\n"]), words


# -- qwen3_coder --


def xml_value(key: str, value: object, rng: random.Random) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return rng.choice([str(value).lower(), str(value)])
    if value is None:
        return "null"
    if isinstance(value, (dict, list)) and rng.random() < 0.3:
        return repr(value)  # a Python literal
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


def xml_call(name: str, args: dict, rng: random.Random) -> str:
    params = "".join(
        f"<parameter={k}>\n{xml_value(k, v, rng)}\n</parameter>\n" for k, v in args.items()
    )
    return f"<function={name}>\n{params}</function>"


def qwen3_coder_case(calls_in: int, rng: random.Random) -> Case:
    lead, content = _lead(rng, "<tool_call>")
    text, calls = [lead], []
    for i in range(calls_in):
        args = typed_arguments(rng) if rng.random() < 0.8 else {}
        name = "typed" if args or rng.random() < 0.5 else "get_time"
        text.append(rng.choice(["\n", ""]) if i else "")
        text.append(f"<tool_call>\n{xml_call(name, args, rng)}\n</tool_call>")
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    tail = rng.choice(["", "\n", "\nDone."])
    text.append(tail)
    if tail.strip():
        content += tail
    return Case("".join(text), content, calls)


# -- mistral --


def mistral_case(calls_in: int, rng: random.Random, compact: bool) -> Case:
    lead, content = _lead(rng, "[TOOL_CALLS]")
    text, calls, objects = [lead], [], []
    for _ in range(calls_in):
        args_text = spaced_json(_json_args(rng), rng)
        name = rng.choice(["get_weather", "f", "a-b_c"])
        calls.append(ToolCall(name, args_text))
        if compact:
            call_id = "[CALL_ID]" + "abc123XYZ" if rng.random() < 0.3 else ""
            objects.append(f"[TOOL_CALLS]{name}{call_id}[ARGS]{args_text}")
        else:
            objects.append(call_object(name, args_text, rng))
    if compact:
        text.append(rng.choice(["", "\n"]).join(objects))
    else:
        text.append("[TOOL_CALLS]" + rng.choice([" [", "["]) + ", ".join(objects) + "]")
    return Case("".join(text), content, calls)


def _json_args(rng: random.Random) -> dict:
    return {_text(rng): _json_value(rng) for _ in range(rng.randint(0, 3))}


# -- pythonic --


def python_literal(value: object, rng: random.Random) -> str:
    """``value`` as Python source: repr, or JSON where JSON and Python agree."""
    if isinstance(value, str) and rng.random() < 0.5:
        return json.dumps(value, ensure_ascii=rng.random() < 0.5)
    return repr(value)


def pythonic_case(calls_in: int, rng: random.Random) -> Case:
    tagged = rng.random() < 0.3
    lead, content = _lead(rng, "<|python_start|>") if tagged else ("", "")
    text = [lead + "<|python_start|>" if tagged else rng.choice(["", " ", "\n"]), "["]
    calls, items = [], []
    for _ in range(calls_in):
        args = _json_args(rng)
        args = {f"k{i}": v for i, v in enumerate(args.values())}  # keys are identifiers
        name = rng.choice(["get_weather", "f", "tools.search"])
        inner = ", ".join(f"{k}={python_literal(v, rng)}" for k, v in args.items())
        items.append(f"{name}({inner})")
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    text.append(rng.choice([", ", ","]).join(items) + "]")
    if tagged and rng.random() < 0.5:
        text.append("<|python_end|>")
    return Case("".join(text), content, calls)
