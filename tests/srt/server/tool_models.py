"""The tokenizer of the tool-calling tests' tiny Qwen2 (written by conftest's
``write_tiny_model``): SmolLM2's with ``<tool_call>`` / ``</tool_call>`` added and a
Qwen2.5-style chat template (tools listed in the system turn, calls written as ``<tool_call>``
JSON blocks, results returned in ``<tool_response>`` blocks). Built locally: nothing is
downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A hermes-style template in the layout Qwen2.5 uses: tools as JSON lines inside <tools>, one
# <tool_call> block per call, tool results in user turns inside <tool_response>.
HERMES_TEMPLATE = (
    "{%- macro call_block(fn) -%}"
    '{{- \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' }}'
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endmacro -%}"
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' }}"
    "{{- messages[0].content if has_system else 'You are a helpful assistant.' }}"
    "{{- '\\n\\n# Tools\\n\\nCall a function when it helps. The functions, one JSON "
    "signature per line:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nWrite each call as JSON with the function name and its "
    'arguments between tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for call in m.tool_calls or [] -%}"
    "{{- '\\n' }}{{- call_block(call.function if call.function is defined else call) }}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' }}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)

TOOL_TOKENS = ("<tool_call>", "</tool_call>")


def hermes_tokenizer(default_model_dir: str | Path) -> Any:
    """SmolLM2's tokenizer with the tool-call tags as added tokens and HERMES_TEMPLATE."""
    from transformers import AddedToken, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok.chat_template = HERMES_TEMPLATE
    return tok
