"""Tool-call parsers by name, and the choice of one from a chat template.

Names: ``hermes`` (aliases ``qwen25``, ``qwen3``), ``qwen3_coder``, ``llama3``, ``pythonic``,
``mistral`` (``mistral_v11`` for templates of the ``[TOOL_CALLS]name[ARGS]`` form), ``gpt-oss``
(harmony channels; alias ``openai``, vLLM's name), ``generic``
(JSON replies for templates without a tool format) and ``none`` (tools refused). ``auto`` is
resolved once from the chat template's text by ``resolve_tool_parser``. Reasoning parsers:
``qwen3`` and ``deepseek-r1`` (``<think>`` blocks) and ``gpt-oss`` (the analysis channel; alias
``openai_gptoss``), made by ``make_reasoning_parser``.
"""

from __future__ import annotations

from radixlm.srt.parsers.generic import GenericParser
from radixlm.srt.parsers.harmony import HarmonyParser, HarmonyReasoningParser
from radixlm.srt.parsers.hermes import HermesParser
from radixlm.srt.parsers.llama3 import Llama3Parser
from radixlm.srt.parsers.mistral import MistralParser, MistralV11Parser
from radixlm.srt.parsers.pythonic import PythonicParser
from radixlm.srt.parsers.qwen3_coder import Qwen3CoderParser
from radixlm.srt.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from radixlm.srt.parsers.tool_base import ToolCallParser, ToolSpec

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls
    for cls in (
        HermesParser,
        Qwen3CoderParser,
        Llama3Parser,
        PythonicParser,
        MistralParser,
        MistralV11Parser,
        HarmonyParser,
        GenericParser,
    )
}
PARSER_NAMES = tuple(TOOL_PARSERS)
ALIASES = {"qwen25": "hermes", "qwen3": "hermes", "openai": "gpt-oss"}
REASONING_ALIASES = {"openai_gptoss": "gpt-oss"}
_SPECIAL = ("auto", "none")


def resolve_tool_parser(name: str, chat_template: str | None) -> str:
    """The concrete parser name for the configured ``name``: aliases map to their parser,
    ``"none"`` stays ``"none"``, ``mistral`` becomes ``mistral_v11`` for a template that writes
    ``[ARGS]``, and ``"auto"`` is read from the template: ``<function=`` with ``<parameter=`` ->
    qwen3_coder; ``<tool_call>`` -> hermes; ``[TOOL_CALLS]`` -> mistral (or mistral_v11); ``<|channel|>`` with ``<|call|>`` (harmony) -> gpt-oss;
    ``<|python_start|>`` or the pythonic call example (``[func_name1(``) -> pythonic;
    ``<|python_tag|>`` or an ``ipython`` role -> llama3; anything else, or no template,
    -> generic. ``ValueError`` for an unknown name."""
    if name == "none":
        return "none"
    if name == "auto":
        return _detect(chat_template or "")
    resolved = ALIASES.get(name, name)
    if resolved not in PARSER_NAMES:
        known = sorted({*PARSER_NAMES, *ALIASES, *_SPECIAL})
        raise ValueError(f"unknown tool-call parser {name!r}; known: {known}")
    if resolved == "mistral" and "[ARGS]" in (chat_template or ""):
        return "mistral_v11"
    return resolved


def _detect(template: str) -> str:
    if "<|channel|>" in template and "<|call|>" in template:
        return "gpt-oss"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral_v11" if "[ARGS]" in template else "mistral"
    if "<|python_start|>" in template or "[func_name1(" in template:
        return "pythonic"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "generic"


def make_tool_parser(name: str, tools: list[ToolSpec]) -> ToolCallParser:
    """A fresh parser (one per response) of the resolved ``name`` (an alias works too)."""
    resolved = ALIASES.get(name, name)
    if resolved not in TOOL_PARSERS:
        raise ValueError(
            f"no tool-call parser {name!r} (resolve 'auto' first; 'none' has no parser); "
            f"known: {sorted(TOOL_PARSERS)}"
        )
    return TOOL_PARSERS[resolved](tools)


def make_reasoning_parser(
    name: str, starts_in_reasoning: bool
) -> ReasoningParser | HarmonyReasoningParser:
    """A fresh reasoning parser (one per response) of ``name`` (an alias works too);
    ``starts_in_reasoning``: the prompt left a ``<think>`` block open (harmony ignores it: its
    channels say where reasoning is). ``ValueError`` for an unknown name."""
    resolved = REASONING_ALIASES.get(name, name)
    if resolved == HarmonyReasoningParser.name:
        return HarmonyReasoningParser(resolved, starts_in_reasoning)
    if resolved not in REASONING_PARSERS:
        known = sorted({*REASONING_PARSERS, *REASONING_ALIASES})
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}")
    return ReasoningParser(resolved, starts_in_reasoning)


def reasoning_needs_markers(name: str) -> bool:
    """Whether the reasoning parser reads markers that tokenizers make special tokens (so
    decoding must keep them): harmony's."""
    return REASONING_ALIASES.get(name, name) == HarmonyReasoningParser.name
