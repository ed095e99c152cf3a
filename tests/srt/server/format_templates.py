"""Chat templates of the qwen3_coder, mistral and pythonic tool formats for the served tests'
tiny random models, written after Qwen3-Coder's, Mistral 7B v0.3's and the Llama 3.2 pythonic
one: each lays the tools and the history's calls and results out as its family does (the turn
markers are SmolLM2's ChatML ones, so the tokenizer's end of turn stays the EOS). Built locally
over SmolLM2's tokenizer: nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TURNS = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' }}{{- CALLS }}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>' + TOOL_ROLE + '\\n' + RESULT + '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)

QWEN3_CODER_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools -%}"
    "{{- '\\n<function>\\n<name>' + tool.function.name + '</name>' }}"
    "{%- for name, p in (tool.function.parameters.properties or {}) | items -%}"
    "{{- '\\n<parameter>\\n<name>' + name + '</name>\\n<type>' + (p.type or 'string') | string"
    " + '</type>\\n</parameter>' }}"
    "{%- endfor -%}"
    "{{- '\\n</function>' }}"
    "{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function reply:\\n<tool_call>\\n<function=NAME>\\n"
    "<parameter=NAME>\\nvalue\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif -%}"
    + _TURNS.replace(
        "CALLS",
        "(m.content or '') }}{%- for c in m.tool_calls -%}"
        "{{- '<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
        "{%- for k, v in c.function.arguments | items -%}"
        "{{- '<parameter=' + k + '>\\n' + (v | tojson if v is mapping or (v is iterable and v"
        " is not string) else v | string) + '\\n</parameter>\\n' }}"
        "{%- endfor -%}"
        "{{- '</function>\\n</tool_call>' }}{%- endfor -%}{{- ''",
    )
    .replace("TOOL_ROLE", "'user'")
    .replace("RESULT", "'<tool_response>\\n' + m.content + '\\n</tool_response>'")
)

# Mistral 7B v0.3's layout: tools in [AVAILABLE_TOOLS], calls as a JSON array after
# [TOOL_CALLS] with ids of 9 letters and digits (checked, as Mistral's template does), results
# in [TOOL_RESULTS] naming the call id.
MISTRAL_TEMPLATE = (
    "{%- if tools -%}{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif -%}"
    + _TURNS.replace(
        "CALLS",
        "'[TOOL_CALLS] [' }}{%- for c in m.tool_calls -%}"
        "{%- if c.id is not defined or c.id | length != 9 -%}"
        "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
        "{%- endif -%}"
        "{{- (c.function | tojson)[:-1] + ', \"id\": \"' + c.id + '\"}' }}"
        "{%- if not loop.last %}{{- ', ' }}{%- endif -%}{%- endfor -%}{{- ']'",
    )
    .replace("TOOL_ROLE", "'user'")
    .replace(
        "RESULT",
        '\'[TOOL_RESULTS] {"content": \' + m.content | tojson + \', "call_id": "\' + '
        "(m.tool_call_id if m.tool_call_id | length == 9 else raise_exception('bad id')) + "
        "'\"}[/TOOL_RESULTS]'",
    )
)

# The Llama 3.2 pythonic layout: the functions as JSON in the system turn with the call
# syntax, calls as a Python list, results in ipython turns.
PYTHONIC_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nYou can call functions. Reply with a list of calls: '"
    " + '[func_name1(params_name1=params_value1, params_name2=params_value2), func_name2(params)]'"
    " + '\\nFunctions:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor -%}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif -%}"
    + _TURNS.replace(
        "CALLS",
        "'[' }}{%- for c in m.tool_calls -%}{{- c.function.name + '(' }}"
        "{%- for k, v in c.function.arguments | items -%}"
        "{{- k + '=' + v | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif -%}"
        "{%- endfor -%}{{- ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif -%}"
        "{%- endfor -%}{{- ']'",
    )
    .replace("TOOL_ROLE", "'ipython'")
    .replace("RESULT", "m.content")
)

TEMPLATES = {
    "qwen3_coder": (QWEN3_CODER_TEMPLATE, ("<tool_call>", "</tool_call>")),
    # ordinary text here: a grammar cannot write special tokens (srt/parsers/README.md)
    "mistral": (
        MISTRAL_TEMPLATE,
        ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]"),
    ),
    "pythonic": (PYTHONIC_TEMPLATE, ()),
}


def format_tokenizer(default_model_dir: str | Path, fmt: str) -> Any:
    """SmolLM2's tokenizer with the format's markup tokens added and its template."""
    from transformers import AddedToken, AutoTokenizer

    template, tokens = TEMPLATES[fmt]
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens])
    tok.chat_template = template
    return tok


# gpt-oss's layout (harmony), after its model card's template: the system message with the
# reasoning effort and the channels, the tools as a TypeScript-like namespace in the developer
# message, one call per assistant message (``to=functions.NAME`` in the role part), results
# from ``functions.NAME`` on the commentary channel, the reply opened with <|start|>assistant.
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are a tiny test model.\\nReasoning: ' + "
    "(reasoning_effort or 'medium') + '\\n\\n# Valid channels: analysis, commentary, final. "
    "Channel must be included for every message.' }}"
    '{%- if tools %}{{- "\\nCalls to these tools must go to the commentary channel: '
    "'functions'.\" }}{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- set has_system = messages and messages[0].role in ('system', 'developer') -%}"
    "{%- if has_system or tools -%}"
    "{{- '<|start|>developer<|message|>' }}"
    "{%- if has_system %}{{- '# Instructions\\n\\n' + messages[0].content + '\\n\\n' }}{%- endif %}"
    "{%- if tools -%}"
    "{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for tool in tools -%}"
    "{{- '// ' + (tool.function.description or '') + '\\ntype ' + tool.function.name + "
    "' = (_: ' + tool.function.parameters | tojson + ') => any;\\n\\n' }}"
    "{%- endfor -%}"
    "{{- '} // namespace functions' }}"
    "{%- endif -%}"
    "{{- '<|end|>' }}"
    "{%- endif -%}"
    "{%- set last = namespace(name=none) -%}"
    "{%- for m in messages -%}"
    "{%- if has_system and loop.first -%}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{%- set call = m.tool_calls[0].function -%}"
    "{%- if m.thinking %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking"
    " + '<|end|>' }}{%- endif -%}"
    "{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json"
    "<|message|>' + call.arguments | tojson + '<|call|>' }}"
    "{%- set last.name = call.name -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' }}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if last.name is none %}{{- raise_exception('a tool result without a call') }}"
    "{%- endif -%}"
    "{{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>'"
    " + m.content | tojson + '<|end|>' }}"
    "{%- else -%}"
    "{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' }}{%- endif -%}"
)
# ordinary text here: a grammar cannot write special tokens (srt/parsers/README.md)
HARMONY_TOKENS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
)
TEMPLATES["gpt-oss"] = (HARMONY_TEMPLATE, HARMONY_TOKENS)
