"""Request bodies of the HTTP API as pydantic models (responses are built as plain dicts).

Native requests use SGLang's field names. OpenAI requests accept the OpenAI fields plus SGLang's
sampling extras (what clients put in ``extra_body`` arrives as top-level fields); other unknown
fields are ignored, as OpenAI-compatible servers do, except the ones in ``UNSUPPORTED_*`` below:
ignoring those would silently change what the request means, so a value other than their
default is a 400. Types are strict: a string is never read as a number or a boolean, and a
boolean is not an integer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


# Fields whose meaning radixlm does not implement: accepted only when absent or at the value
# that means "off" (listed), so a request never gets silently different sampling.
UNSUPPORTED_NATIVE = {
    "image_data": (None, [], ""),
    "audio_data": (None, [], ""),
    "video_data": (None, [], ""),
    "input_embeds": (None, []),
    "lora_path": (None, ""),
    "custom_logit_processor": (None, ""),
    "session_params": (None, {}),
    "return_hidden_states": (None, False),
}
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


# ---------------------------------------------------------------------- native API
class GenerateReqInput(_Body):
    """``POST /generate``: one prompt or a batch (lists), as text or token ids."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


class AbortRequestInput(_Body):
    rid: str = ""
    abort_all: bool = False  # needs the admin key when one is set


class TokenizeInput(_Body):
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeInput(_Body):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


# ---------------------------------------------------------------------- OpenAI API
class StreamOptions(_Body):
    include_usage: bool = False


class SGLangSamplingExtras(_Body):
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


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(OpenAISamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


# ---------------------------------------------------------------------- errors (OpenAPI only)
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---------------------------------------------------------------------- cheap size checks
# Run on the decoded JSON before model validation, which holds the GIL for a while on
# hundreds of thousands of items (and so would stall every other request).
Precheck = Callable[[dict[str, Any]], None]


def _check_len(value: Any, limit: int, name: str) -> None:
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"{name} has {len(value)} entries; at most {limit}")


def precheck_batch(data: dict[str, Any], max_items: int, context_length: int) -> None:
    """Batches (``text``, ``input_ids`` lists of prompts, ``prompt`` lists) are bounded, and
    so is each token-id prompt (by the context length)."""
    for name in ("text", "input_ids", "prompt"):
        value = data.get(name)
        if not isinstance(value, list) or not value:
            continue
        is_flat_ids = not isinstance(value[0], (list, str))
        if not is_flat_ids:  # a batch: of texts or of token-id lists
            _check_len(value, max_items, name)
        rows = [value] if is_flat_ids else value
        longest = max((len(r) for r in rows if isinstance(r, list)), default=0)
        if longest >= context_length:
            raise ValueError(
                f"{name} has a prompt of {longest} token ids; the context holds "
                f"{context_length} tokens"
            )


def precheck_chat(data: dict[str, Any], max_items: int) -> None:
    """No more messages, nor content parts, than the context has tokens."""
    messages = data.get("messages")
    _check_len(messages, max_items, "messages")
    parts = sum(
        len(m["content"])
        for m in messages or ()
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if parts > max_items:
        raise ValueError(f"messages hold {parts} content parts; at most {max_items}")
