"""Reasoning blocks: ``<think>...</think>`` before the answer (Qwen3, DeepSeek-R1).

The block is either opened by the model (the output starts with ``<think>``, after optional
whitespace) or already open when the output starts: the rendered prompt ended inside an opened
``<think>`` (``starts_in_reasoning_for``), or the model is DeepSeek-R1, whose outputs are read
as starting in reasoning either way (it may also repeat the ``<think>``, which is dropped).
Whitespace right after ``<think>``, before ``</think>`` and right after it is markup. An
output that ends before ``</think>`` is all reasoning and no content. After ``</think>``
everything is content, markers included; an output that does not start in reasoning and does
not open a block is all content.

``split`` (a whole output) and ``feed``/``flush`` (streamed) agree for every split of the text;
what is held back between deltas is at most a partial marker and the whitespace before it.
"""

from __future__ import annotations

import json
import re

from radixlm.srt.parsers.json_stream import skip_whitespace
from radixlm.srt.parsers.markers import WHITESPACE, WS_HOLD, MarkerSplitter, partial_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
THINK_PARSERS = ("qwen3", "deepseek-r1")  # <think> blocks (this module)
# all reasoning parsers: gpt-oss's harmony channels are read by harmony.py
REASONING_PARSERS = (*THINK_PARSERS, "gpt-oss")
_ALWAYS_STARTS_IN_REASONING = ("deepseek-r1",)

_START, _LEAD, _REASONING, _AFTER_CLOSE, _CONTENT = range(5)


def starts_in_reasoning_for(prompt: str) -> bool:
    """Whether the rendered generation prompt ends inside an opened ``<think>`` block."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def text_without(marker: str) -> str:
    """A regex (Python and Rust syntax) matching exactly the texts that do not contain
    ``marker``, whose first character must occur in it only once (as in ``</think>``)."""
    first, rest = marker[0], marker[1:]
    assert len(marker) > 1 and first not in rest, marker
    prefix = ""  # any proper prefix of rest: (?:/(?:t(?:h...)?)?)?
    for c in reversed(rest[:-1]):
        prefix = f"(?:{re.escape(c)}{prefix})?"
    exits = "|".join(
        f"{re.escape(rest[:k])}[^{_class_char(rest[k])}{_class_char(first)}]"
        for k in range(len(rest))
    )
    restart = f"(?:{prefix}{re.escape(first)})*"
    block = f"[^{_class_char(first)}]|{re.escape(first)}{restart}(?:{exits})"
    return f"(?:{block})*(?:{re.escape(first)}{restart}{prefix})?"


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


class ReasoningParser:
    """Splits one output into reasoning and content; one instance per response."""

    def __init__(self, name: str, starts_in_reasoning: bool) -> None:
        if name not in THINK_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; known: {THINK_PARSERS}")
        self.name = name
        self.starts_in_reasoning = starts_in_reasoning or name in _ALWAYS_STARTS_IN_REASONING
        self._state = _START
        self._has_block = self.starts_in_reasoning
        self._held = ""  # at the start: whitespace and a partial <think>
        self._close = MarkerSplitter(THINK_CLOSE)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning is None when it has no block."""
        fresh = ReasoningParser(self.name, self.starts_in_reasoning)
        reasoning, content = fresh.feed(text)
        more_reasoning, more_content = fresh.flush()
        if not fresh._has_block:
            return None, content + more_content
        return reasoning + more_reasoning, content + more_content

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) of the next piece of output."""
        reasoning: list[str] = []
        content: list[str] = []
        pos = 0
        while pos < len(delta):
            pos = self._step(delta, pos, reasoning, content)
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of output: what is held back (a partial marker) is reasoning or content."""
        held, self._held = self._held, ""
        if self._state == _START:
            return (held.lstrip(WHITESPACE), "") if self.starts_in_reasoning else ("", held)
        if self._state == _REASONING:
            return self._close.flush(), ""
        return "", ""

    def _step(self, text: str, pos: int, reasoning: list[str], content: list[str]) -> int:
        if self._state == _START:
            return self._start(text, pos, reasoning, content)
        if self._state in (_LEAD, _AFTER_CLOSE):
            stop = skip_whitespace(text, pos, len(text))
            if stop < len(text):
                self._state = _REASONING if self._state == _LEAD else _CONTENT
            return stop
        if self._state == _CONTENT:
            content.append(text[pos:])
            return len(text)
        before, _, after = self._close.scan(text, pos)
        reasoning.append(before)
        if after is None:
            return len(text)
        self._state = _AFTER_CLOSE
        return after

    def _start(self, text: str, pos: int, reasoning: list[str], content: list[str]) -> int:
        """``<think>`` after at most ``WS_HOLD`` whitespace characters opens the block;
        anything else ends the start, and the held text is read again after it."""
        held = self._held + text[pos:]
        body = held.lstrip(WHITESPACE)
        if len(held) - len(body) <= WS_HOLD:
            if body.startswith(THINK_OPEN):
                self._held, self._state, self._has_block = "", _LEAD, True
                return len(text) - (len(body) - len(THINK_OPEN))
            if partial_suffix(body, THINK_OPEN) == len(body):  # empty, or a partial <think>
                self._held = held
                return len(text)
        old, self._held = self._held, ""
        self._state = _LEAD if self.starts_in_reasoning else _CONTENT
        i = 0
        while i < len(old):
            i = self._step(old, i, reasoning, content)
        return pos

    def wrap_constraint(self, fragment: dict | None) -> dict | None:
        """A structural tag that leaves the reasoning block free and applies ``fragment``
        (``json_schema``, ``structural_tag``, ``regex``, ``ebnf`` or ``choices``) after
        ``</think>``: when
        the output starts in reasoning, text up to ``</think>``; else either a block opened by
        the model or none. None stays None."""
        if fragment is None:
            return None
        after = constraint_format(fragment)
        block = re.escape(THINK_CLOSE) + r"\n{0,2}"
        reasoning = {"type": "regex", "pattern": text_without(THINK_CLOSE) + block}
        if self.starts_in_reasoning:
            fmt = {"type": "sequence", "elements": [reasoning, after]}
        else:  # the opening marker as a literal, so that it competes only with literals
            opening = {"type": "const_string", "value": THINK_OPEN}
            opened = {"type": "sequence", "elements": [opening, reasoning, after]}
            fmt = {"type": "or", "elements": [opened, after]}
        return {"structural_tag": {"type": "structural_tag", "format": fmt}}


def constraint_format(fragment: dict) -> dict:
    """The structural-tag format of a sampling-params constraint fragment (one key of
    ``json_schema``, ``structural_tag``, ``regex``, ``ebnf``, ``choices``; JSON values may be
    text)."""
    if len(fragment) != 1:
        raise ValueError(f"a constraint fragment has one key, got {sorted(fragment)}")
    ((kind, value),) = fragment.items()
    if kind == "regex":
        return {"type": "regex", "pattern": value}
    if kind == "ebnf":
        return {"type": "grammar", "grammar": value}
    if kind == "choices":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in value]}
    if isinstance(value, str):
        value = json.loads(value)
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": value}
    if kind != "structural_tag":
        raise ValueError(f"unknown constraint kind {kind!r}")
    if "format" in value:
        return value["format"]
    tags = [
        {
            "type": "tag",
            "begin": s["begin"],
            "content": {"type": "json_schema", "json_schema": s["schema"]},
            "end": s["end"],
        }
        for s in value["structures"]
    ]
    return {"type": "triggered_tags", "triggers": value["triggers"], "tags": tags}
