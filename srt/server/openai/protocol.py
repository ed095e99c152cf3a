"""Request bodies of the OpenAI-compatible routes as pydantic models (responses are plain dicts).

OpenAI requests accept the OpenAI fields plus SGLang's sampling extras (what clients put in
``extra_body`` arrives as top-level fields); other unknown fields are ignored, as
OpenAI-compatible servers do, except the ones in ``UNSUPPORTED_CHAT`` and
``UNSUPPORTED_COMPLETION`` (OpenAI's, SGLang's and vLLM's fields this server does not
implement): ignoring those would silently change what the request means, so a value other than
their default is a 400. Fields that only label or route a request (``user``, ``session_id``,
``custom_labels``, ``request_id``, ``metadata``, ``store``...) are accepted without effect. A
``null`` for a field with a non-null default means that default (errors.parse_body).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from radixlm.srt.server.native.protocol import StrictBody, check_list_len, check_rid
from radixlm.srt.server.openai.vllm_compat import translate_vllm_fields

_UNSUPPORTED_BOTH = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "moderation": (None,),  # a check the server does not run
    # SGLang's and vLLM's extensions this server does not implement (their off values)
    "lora_path": (None, ""),
    "custom_logit_processor": (None, ""),
    "logits_processors": (None, []),
    "return_hidden_states": (None, False),
    "return_routed_experts": (None, False),
    "routed_experts_start_len": (None, 0),
    "return_spec_tokens_details": (None, False),
    "return_token_ids": (None, False),
    "return_tokens_as_token_ids": (None, False),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "disagg_prefill_dp_rank": (None,),
    "kv_transfer_params": (None,),
    "data_parallel_rank": (None, 0),
    "routed_dp_rank": (None, 0),
    "session_params": (None,),
    "images_config": (None,),
    "mm_processor_kwargs": (None, {}),
    "watermark": (None,),
    "extra_key": (None, ""),
    "cache_salt": (None, ""),
    "priority": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "prompt_embeds": (None,),
    "vllm_xargs": (None, {}),
}
# chat takes tools (chat/tools.py); the deprecated functions / function_call are refused
# with their own message by precheck_chat
UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_BOTH,
    "web_search_options": (None,),  # a search the server does not run: a 400, not silence
    "verbosity": (None, "medium"),  # OpenAI's answer-length hint: no model here is trained on it
    "echo": (None, False),  # vLLM: the last message's content before the reply
    "chat_template": (None,),  # a client's own Jinja template
    "documents": (None,),
    "input_ids": (None,),
    "return_prompt_token_ids": (None, False),
    "return_meta_info": (None, False),
    "return_input_ids_in_sglext": (None, False),
    "return_output_ids_in_sglext": (None, False),
    "return_sampling_mask": (None, False),
    "sampling_logprobs_mode": (None, "selected"),
    "return_flat_raw_output_top_logprobs": (None, False),
    "thinking": (None,),
    "task": (None,),
    "stream_reasoning": (None, True),
    "max_dynamic_patch": (None,),
    "min_dynamic_patch": (None,),
    "use_audio_in_video": (None, False),
    "video_config": (None,),
}
UNSUPPORTED_COMPLETION = {
    **_UNSUPPORTED_BOTH,
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}


# ---------------------------------------------------------------------- OpenAI API
class StreamOptions(StrictBody):
    include_usage: bool = False
    # SGLang / vLLM: every chunk carries its choice's usage so far
    continuous_usage_stats: bool = False


class SGLangSamplingExtras(StrictBody):
    """SGLang sampling parameters accepted on the OpenAI routes (``extra_body``)."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    choices: list[str] | None = None  # the output is exactly one of these (vLLM's guided_choice)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_regex: str | list[str] | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    rid: str | None = None

    _rid_not_empty = field_validator("rid")(classmethod(lambda cls, rid: check_rid(rid)))


class OpenAISamplingFields(SGLangSamplingExtras):
    model: str | None = None  # missing: the served model
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class JsonSchemaFormat(StrictBody):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object``, ``json_schema`` (OpenAI) or ``structural_tag`` (SGLang: its
    other fields, such as ``structures`` and ``triggers`` or ``format``, are the tag itself and
    are kept whole)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(OpenAISamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # default: 16, as OpenAI
    logprobs: int | None = None
    echo: bool = False
    response_format: ResponseFormat | None = None


class ContentPart(StrictBody):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's "refusal" part (a history from OpenAI)


class FunctionCallParam(StrictBody):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(StrictBody):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer
    reasoning_content: str | None = None  # assistant messages of a reasoning model


class FunctionDef(StrictBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(StrictBody):
    type: str = "function"  # chat/tools.py refuses other kinds with its own message
    function: FunctionDef


class ChatCompletionRequest(OpenAISamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = (
        None  # missing: true, except one call under a named tool_choice
    )
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM / SGLang: the reply continues the last (assistant) message instead of opening a
    # new turn; add_generation_prompt false renders no assistant header (chat/tools.py)
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    reasoning_effort: str | None = None  # "none": enable_thinking false (chat/tools.py)
    separate_reasoning: bool = True  # false: reasoning stays in content


_LEGACY_FUNCTIONS = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}


def precheck_chat(data: dict[str, Any], max_items: int) -> None:
    """vLLM's structured-output fields read as ours (``vllm_compat``); no more messages, nor
    content parts, than the context has tokens; the deprecated ``functions`` /
    ``function_call`` are refused by name (send ``tools`` / ``tool_choice``)."""
    translate_vllm_fields(data)
    for name, off_values in _LEGACY_FUNCTIONS.items():
        if name in data and data[name] not in off_values:
            raise ValueError(
                f"{name} is the deprecated form of tools / tool_choice and is not supported; "
                "send tools (and tool_choice)"
            )
    messages = data.get("messages")
    check_list_len(messages, max_items, "messages")
    check_list_len(data.get("tools"), max_items, "tools")
    parts = sum(
        len(m["content"])
        for m in messages or ()
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if parts > max_items:
        raise ValueError(f"messages hold {parts} content parts; at most {max_items}")
