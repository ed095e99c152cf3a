"""Request bodies of the OpenAI-compatible routes as pydantic models (responses are plain dicts).

OpenAI requests accept the OpenAI fields plus SGLang's sampling extras (what clients put in
``extra_body`` arrives as top-level fields); other unknown fields are ignored, as
OpenAI-compatible servers do, except the ones in ``UNSUPPORTED_OPENAI``: ignoring those would
silently change what the request means, so a value other than their default is a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixlm.srt.server.protocol import StrictBody, check_list_len

UNSUPPORTED_OPENAI = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
}


# ---------------------------------------------------------------------- OpenAI API
class StreamOptions(StrictBody):
    include_usage: bool = False


class SGLangSamplingExtras(StrictBody):
    """SGLang sampling parameters accepted on the OpenAI routes (``extra_body``)."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    rid: str | None = None


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


class CompletionRequest(OpenAISamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # default: 16, as OpenAI
    logprobs: int | None = None
    echo: bool = False


class ContentPart(StrictBody):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class JsonSchemaFormat(StrictBody):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(OpenAISamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


def precheck_chat(data: dict[str, Any], max_items: int) -> None:
    """No more messages, nor content parts, than the context has tokens."""
    messages = data.get("messages")
    check_list_len(messages, max_items, "messages")
    parts = sum(
        len(m["content"])
        for m in messages or ()
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if parts > max_items:
        raise ValueError(f"messages hold {parts} content parts; at most {max_items}")
