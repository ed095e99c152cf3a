"""Request bodies of the native (SGLang) API as pydantic models, and the cheap size checks run
before any body is validated; the OpenAI routes' bodies are in openai_protocol.py.

Native requests use SGLang's field names; unknown fields are ignored, except the ones in
``UNSUPPORTED_NATIVE`` below: ignoring those would silently change what the request means, so a
value other than their default is a 400. Types are strict: a string is never read as a number
or a boolean, and a boolean is not an integer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict


class StrictBody(BaseModel):
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


# ---------------------------------------------------------------------- native API
class GenerateReqInput(StrictBody):
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


class AbortRequestInput(StrictBody):
    rid: str = ""
    abort_all: bool = False  # needs the admin key when one is set


class TokenizeInput(StrictBody):
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeInput(StrictBody):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


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


def check_list_len(value: Any, limit: int, name: str) -> None:
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
            check_list_len(value, max_items, name)
        rows = [value] if is_flat_ids else value
        longest = max((len(r) for r in rows if isinstance(r, list)), default=0)
        if longest >= context_length:
            raise ValueError(
                f"{name} has a prompt of {longest} token ids; the context holds "
                f"{context_length} tokens"
            )
