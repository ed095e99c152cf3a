"""render: chat history and tools through real chat templates (written here after the Qwen2.5,
Llama 3.1 and SmolLM2 ones, rendered by a locally built transformers tokenizer)."""

from __future__ import annotations

import copy
import json

import pytest

from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.srt.parsers.registry import make_tool_parser, resolve_tool_parser
from radixlm.srt.parsers.tool_base import ToolCall, ToolSpec

# Qwen2.5-style: tools listed in the system turn, calls in <tool_call> blocks with `tojson`
# arguments, results in <tool_response> blocks of one user turn.
HERMES_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments '
    'within <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
      or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Llama 3.1-style JSON tool calling: tools in the first user turn, one call per message.
LLAMA3_TEMPLATE = """
{%- set ns = namespace(listed=false) %}
{%- for message in messages %}
{%- if message.role == 'user' and tools and not ns.listed %}
{%- set ns.listed = true %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond with '
    'a JSON for a function call.\\n\\n' }}
{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls | length == 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' + (tool_call.arguments | tojson) + '}' }}
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content }}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# SmolLM2-style ChatML without any tool support.
CHATML_TEMPLATE = """
{%- for message in messages %}
{%- if loop.first and messages[0].role != 'system' %}
{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM<|im_end|>\\n' }}
{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

WEATHER = ToolSpec(
    "get_weather",
    "Current weather of a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CLOCK = ToolSpec("get_time", None)
TOOLS = [WEATHER, CLOCK]

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "user", "content": "Thanks! And Lyon?"},
]


def render(parser: str, template: str, messages: list[dict], choice: str = "auto") -> str:
    before = copy.deepcopy(messages)
    rendered, kwargs = make_tool_parser(parser, TOOLS).render(messages, TOOLS, choice)
    assert messages == before  # the input is not modified
    tokenizer = train_byte_level_tokenizer()
    return tokenizer.apply_chat_template(
        rendered, chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs
    )


def _turns(prompt: str, start: str, end: str) -> list[str]:
    return [part.split(end)[0] for part in prompt.split(start)[1:]]


def test_hermes_render_through_a_qwen25_style_template() -> None:
    prompt = render("hermes", HERMES_TEMPLATE, HISTORY)
    tool_lines = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in tool_lines] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather of a city",
                "parameters": WEATHER.parameters,
            },
        },
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    # earlier calls: arguments as JSON objects (not JSON strings inside JSON), and they parse
    # back into the calls they came from
    assistant = [t for t in _turns(prompt, "<|im_start|>assistant", "<|im_end|>") if t.strip()]
    assert '"arguments": {"city": "Paris"}}' in assistant[0]
    assert make_tool_parser("hermes", TOOLS).parse(assistant[0]).calls == [
        ToolCall("get_weather", '{"city": "Paris"}'),
        ToolCall("get_time", "{}"),
    ]
    results = "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
    assert results + "<tool_response>\n14:05\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("Thanks! And Lyon?<|im_end|>\n<|im_start|>assistant\n")


def test_hermes_render_under_none_lists_no_tools() -> None:
    prompt = render("hermes", HERMES_TEMPLATE, HISTORY, choice="none")
    assert "# Tools" not in prompt and "<tools>" not in prompt
    assert '"arguments": {"city": "Paris"}' in prompt  # the history still renders


def test_llama3_render_splits_multi_call_messages_for_the_template() -> None:
    prompt = render("llama3", LLAMA3_TEMPLATE, HISTORY)
    calls = _turns(prompt, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    assert calls[:2] == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "get_time", "parameters": {}}',
    ]
    parser = make_tool_parser("llama3", TOOLS)
    assert parser.parse(calls[0]).calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n18°C, sunny<|eot_id|>" in prompt
    with_text = copy.deepcopy(HISTORY)
    with_text[2]["content"] = "Checking."
    assert "assistant<|end_header_id|>\n\nChecking.<|eot_id|>" in render(
        "llama3", LLAMA3_TEMPLATE, with_text
    )


def test_generic_render_describes_tools_in_the_system_prompt() -> None:
    prompt = render("generic", CHATML_TEMPLATE, HISTORY)
    system = _turns(prompt, "<|im_start|>system\n", "<|im_end|>")[0]
    assert system.startswith("Be brief.\n\n")  # the client's system text comes first
    described = [json.loads(line) for line in system.splitlines() if line.startswith('{"name"')]
    assert described == [
        {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": WEATHER.parameters,
        },
        {"name": "get_time", "description": "", "parameters": CLOCK.parameters},
    ]
    assert '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}' in system
    assert '{"content": "<your answer>"}' in system
    # the earlier calls as the JSON reply the model gives, and they parse back
    assistant = _turns(prompt, "<|im_start|>assistant\n", "<|im_end|>")
    assert make_tool_parser("generic", TOOLS).parse(assistant[0]).calls == [
        ToolCall("get_weather", '{"city": "Paris"}'),
        ToolCall("get_time", "{}"),
    ]
    users = _turns(prompt, "<|im_start|>user\n", "<|im_end|>")
    assert users[1] == (
        'Result of the tool "get_weather" (call id "call_1"):\n18°C, sunny\n\n'
        'Result of the tool "get_time" (call id "call_2"):\n14:05'
    )
    assert users[2] == "Thanks! And Lyon?"


def test_generic_render_without_a_system_message_and_by_choice() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather?"},
    ]
    prompt = render("generic", CHATML_TEMPLATE, messages)
    assert "SmolLM" not in prompt and "get_weather" in prompt
    assert '<|im_start|>assistant\n{"content": "Hello!"}<|im_end|>' in prompt  # earlier answer
    required = render("generic", CHATML_TEMPLATE, messages, choice="required")
    assert "You must call one or more tools" in required and "To answer" not in required
    named = render("generic", CHATML_TEMPLATE, messages, choice="function:get_time")
    assert 'You must call the tool "get_time"' in named
    plain = render("generic", CHATML_TEMPLATE, messages, choice="none")
    assert "get_weather" not in plain and "SmolLM" in plain
    assert "<|im_start|>assistant\nHello!<|im_end|>" in plain


ANSWER_LINE = 'Once the tool results answer the question, answer in this form: {"content": "'


def test_generic_render_under_auto_asks_for_an_answer_after_the_results() -> None:
    system = _turns(
        render("generic", CHATML_TEMPLATE, HISTORY), "<|im_start|>system\n", "<|im_end|>"
    )
    assert ANSWER_LINE + '<your answer>"}' in system[0]
    for forced in ("required", "function:get_weather"):
        assert ANSWER_LINE not in render("generic", CHATML_TEMPLATE, HISTORY, choice=forced)


def _prose_turns(prompt: str) -> tuple[list[str], list[str]]:
    assert "tool_calls" not in prompt and '{"content"' not in prompt  # no reply format
    assert "Reply with" not in prompt and "call id" not in prompt
    assistant = _turns(prompt, "<|im_start|>assistant\n", "<|im_end|>")
    return assistant, _turns(prompt, "<|im_start|>user\n", "<|im_end|>")


def test_generic_render_under_none_tells_calls_and_results_in_prose() -> None:
    assistant, users = _prose_turns(render("generic", CHATML_TEMPLATE, HISTORY, choice="none"))
    assert (
        assistant[0] == 'I called get_weather with {"city": "Paris"}.\nI called get_time with {}.'
    )
    assert (
        users[1]
        == "The tool get_weather returned: 18°C, sunny\n\nThe tool get_time returned: 14:05"
    )
    assert users[2] == "Thanks! And Lyon?"


def test_generic_render_without_tools_tells_the_history_in_prose() -> None:
    messages = copy.deepcopy(HISTORY[1:4])
    messages[1]["content"] = "Checking."
    messages[1]["tool_calls"] = messages[1]["tool_calls"][:1]
    messages += [
        {"role": "tool", "tool_call_id": "call_9", "content": [{"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "Sunny, 18°C."},
    ]
    rendered, kwargs = make_tool_parser("generic", []).render(messages, [], "auto")
    assert kwargs == {} and [m["role"] for m in rendered] == [
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    prompt = train_byte_level_tokenizer().apply_chat_template(
        rendered, chat_template=CHATML_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assistant, users = _prose_turns(prompt)
    assert assistant[:2] == [
        'Checking.\n\nI called get_weather with {"city": "Paris"}.',
        "Sunny, 18°C.",
    ]
    assert users[1] == "The tool get_weather returned: 18°C, sunny\n\nA tool returned: ?"


@pytest.mark.parametrize(
    ("configured", "template", "expected"),
    [
        ("auto", HERMES_TEMPLATE, "hermes"),
        ("auto", LLAMA3_TEMPLATE, "llama3"),
        ("auto", CHATML_TEMPLATE, "generic"),
        ("auto", None, "generic"),
        ("qwen25", None, "hermes"),
        ("qwen3", CHATML_TEMPLATE, "hermes"),
        ("llama3", HERMES_TEMPLATE, "llama3"),
        ("none", HERMES_TEMPLATE, "none"),
        # Qwen3-Coder writes <tool_call> too: its <function=/<parameter= decide
        ("auto", "<tool_call>\n<function={{ n }}>\n<parameter={{ k }}>", "qwen3_coder"),
        ("auto", "{{ '[TOOL_CALLS] [' }}{{ calls | tojson }}", "mistral"),
        ("auto", "{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", "mistral_v11"),
        ("mistral", "{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", "mistral_v11"),
        ("mistral", None, "mistral"),
        ("auto", "{{ '<|python_start|>' }} ipython", "pythonic"),
        ("auto", "Reply as [func_name1(params_name1=params_value1)]", "pythonic"),
        ("pythonic", LLAMA3_TEMPLATE, "pythonic"),
    ],
)
def test_resolve_tool_parser(configured: str, template: str | None, expected: str) -> None:
    assert resolve_tool_parser(configured, template) == expected


def test_unknown_parser_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        resolve_tool_parser("kimi_k2", None)  # gpt-oss is known now
    with pytest.raises(ValueError, match="no tool-call parser"):
        make_tool_parser("none", [])
