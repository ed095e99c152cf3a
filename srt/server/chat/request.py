"""The chat request every chat dialect is read into: OpenAI's chat body (its fields plus
SGLang's sampling extras), which the OpenAI chat route takes as it is and the Responses and
Anthropic Messages routes build from their own bodies (``anthropic/messages_input.chat_request``
is the rule: a dialect translates its body into this request, and the shared pipeline, plan.py,
tools.py, tool_stream.py, does the rest)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from radixlm.srt.server.http.body import StrictBody, check_rid


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
    user: str | None = None  # without API keys, the namespace of the request's rid
    priority: int | None = None  # SGLang's: orders the queue with --enable-priority-scheduling
    # vLLM's and SGLang's: cached prefixes are shared only between requests with the same
    # salt, in every KV tier ("" or null: no salt); checked by the front door
    cache_salt: str | None = None
    # prefill-decode disaggregation (sglang-router's PD mode): one value, or one per choice;
    # taken by prefill and decode workers only (the front door refuses them elsewhere)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None


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
