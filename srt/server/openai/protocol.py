"""Request bodies of the OpenAI-compatible routes as pydantic models (responses are plain dicts);
the chat body is the chat request all chat dialects share, in chat/request.py.

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

from typing import Any

from radixlm.srt.server.chat.request import OpenAISamplingFields, ResponseFormat
from radixlm.srt.server.http.body import check_list_len, check_tool_count
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
    "disagg_prefill_dp_rank": (None,),
    "kv_transfer_params": (None,),
    "data_parallel_rank": (None, 0),
    "routed_dp_rank": (None, 0),
    "session_params": (None,),
    "images_config": (None,),
    "mm_processor_kwargs": (None, {}),
    "watermark": (None,),
    "extra_key": (None, ""),
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


class CompletionRequest(OpenAISamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # default: 16, as OpenAI
    logprobs: int | None = None
    echo: bool = False
    response_format: ResponseFormat | None = None


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
    check_tool_count(data.get("tools"))
    parts = sum(
        len(m["content"])
        for m in messages or ()
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if parts > max_items:
        raise ValueError(f"messages hold {parts} content parts; at most {max_items}")
