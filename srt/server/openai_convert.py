"""OpenAI requests -> native generate inputs, and native outputs -> OpenAI response pieces."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixlm.srt.managers.tokenizer_manager import GenerateError, GenerateInput, TokenizerManager
from radixlm.srt.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAISamplingFields,
    ResponseFormat,
)

MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
JSON_OBJECT_SCHEMA = '{"type": "object"}'

# OpenAI / SGLang-extra field -> native sampling parameter
_PASSTHROUGH = {
    "temperature": "temperature", "top_p": "top_p", "stop": "stop",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens",
    "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf", "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids", "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
}


@dataclass
class OpenAIPlan:
    """The native requests behind one OpenAI request: ``n`` per prompt, prompt-major."""

    inputs: list[GenerateInput] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)  # one per prompt
    n: int = 1

    def prompt_of(self, choice: int) -> int:
        return choice // self.n


def check_model(requested: str, accepted: set[str]) -> None:
    if requested not in accepted:
        raise GenerateError(
            f"the model {requested!r} does not exist; this server serves "
            f"{sorted(accepted)[0]!r} (see /v1/models)", 404, "model", "model_not_found",
        )


def sampling_params(req: OpenAISamplingFields, max_new_tokens: int) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for name, native in _PASSTHROUGH.items():
        value = getattr(req, name)
        if value is not None:
            sp[native] = value
    return sp


def _check_n(n: int) -> None:
    if n < 1:
        raise GenerateError(f"n must be >= 1, got {n}", 400, "n")


def _expand(plan: OpenAIPlan, req: OpenAISamplingFields, ids: list[int], sp: dict[str, Any],
            logprob: tuple[bool, int, int]) -> None:
    """Adds ``req.n`` native inputs for one prompt (seeded samples get seeds seed, seed+1, ...)."""
    return_logprob, start_len, top_num = logprob
    prompt_index = len(plan.prompt_texts) - 1
    for j in range(req.n):
        sample_sp = dict(sp)
        if req.seed is not None:
            sample_sp["seed"] = req.seed + j
        rid = None
        if req.rid is not None:
            rid = req.rid if plan.n == 1 and prompt_index == 0 else f"{req.rid}-{prompt_index}-{j}"
        plan.inputs.append(GenerateInput(
            input_ids=ids, sampling_params=sample_sp, rid=rid, return_logprob=return_logprob,
            logprob_start_len=start_len, top_logprobs_num=top_num,
            return_text_in_logprobs=True, stream=req.stream,
        ))


# ---------------------------------------------------------------------- chat
def _message_dict(msg: ChatMessage) -> dict[str, Any]:
    out = msg.model_dump(exclude_none=True)
    out["role"] = "system" if msg.role == "developer" else msg.role
    if isinstance(msg.content, list):
        parts = []
        for part in msg.content:
            if part.type != "text":
                raise GenerateError(f"content parts of type {part.type!r} are not supported; "
                                    "send text", 400, "messages")
            parts.append(part.text or "")
        out["content"] = "".join(parts)
    elif msg.content is None:
        out["content"] = ""
    return out


def chat_prompt(tm: TokenizerManager, messages: list[ChatMessage]) -> str:
    if not getattr(tm.tokenizer, "chat_template", None):
        raise GenerateError("this model has no chat template; use /v1/completions", 400)
    try:
        return tm.tokenizer.apply_chat_template(
            [_message_dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
    except GenerateError:
        raise
    except Exception as e:
        raise GenerateError(f"cannot apply the chat template: {e}", 400, "messages") from None


def response_format_schema(fmt: ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise GenerateError("response_format json_schema needs json_schema.schema", 400,
                            "response_format")
    return json.dumps(fmt.json_schema.schema_)


def chat_plan(req: ChatCompletionRequest, tm: TokenizerManager) -> OpenAIPlan:
    _check_n(req.n)
    top = req.top_logprobs or 0
    if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
        raise GenerateError(f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}",
                            400, "top_logprobs")
    if top and not req.logprobs:
        raise GenerateError("top_logprobs needs logprobs: true", 400, "top_logprobs")
    prompt = chat_prompt(tm, req.messages)
    ids = tm.tokenize(prompt, add_special_tokens=False)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_new is None:
        max_new = max(tm.context_length - len(ids), 0)
    sp = sampling_params(req, max_new)
    schema = response_format_schema(req.response_format)
    if schema is not None:
        if req.json_schema is not None:
            raise GenerateError("give response_format or json_schema, not both", 400, "json_schema")
        sp["json_schema"] = schema
    plan = OpenAIPlan(prompt_texts=[prompt], n=req.n)
    _expand(plan, req, ids, sp, (req.logprobs, -1, top))
    return plan


# ---------------------------------------------------------------------- completions
def _completion_prompts(tm: TokenizerManager, prompt: Any) -> list[tuple[str, list[int]]]:
    if isinstance(prompt, str):
        return [(prompt, tm.tokenize(prompt))]
    if not prompt:
        raise GenerateError("prompt is empty", 400, "prompt")
    if isinstance(prompt[0], str):
        return [(p, tm.tokenize(p)) for p in prompt]
    if isinstance(prompt[0], int):
        return [(tm.decode(prompt, skip_special_tokens=False), list(prompt))]
    return [(tm.decode(p, skip_special_tokens=False), list(p)) for p in prompt]


def completion_plan(req: CompletionRequest, tm: TokenizerManager) -> OpenAIPlan:
    _check_n(req.n)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise GenerateError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got "
                            f"{req.logprobs}", 400, "logprobs")
    plan = OpenAIPlan(n=req.n)
    return_logprob = req.logprobs is not None
    logprob = (return_logprob, 0 if req.echo and return_logprob else -1, req.logprobs or 0)
    sp = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens)
    for text, ids in _completion_prompts(tm, req.prompt):
        plan.prompt_texts.append(text)
        _expand(plan, req, ids, sp, logprob)
    return plan


# ---------------------------------------------------------------------- outputs
def finish_reason(out: dict[str, Any]) -> str | None:
    reason = out["meta_info"]["finish_reason"]
    if reason is None:
        return None
    if reason["type"] == "abort":
        raise GenerateError(f"the request was aborted: {reason.get('message', '')}", 400)
    return "length" if reason["type"] == "length" else "stop"


def usage(outs: list[dict[str, Any]], plan: OpenAIPlan) -> dict[str, Any]:
    """Prompt tokens count once per prompt, completion tokens once per choice."""
    firsts = [outs[p * plan.n]["meta_info"] for p in range(len(plan.prompt_texts))]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)},
    }


def _bytes(text: str | None) -> list[int]:
    return list((text or "").encode("utf-8"))


def chat_logprobs(entries: list[list[Any]], tops: list[Any]) -> dict[str, Any]:
    content = []
    for i, (lp, _, text) in enumerate(entries):
        row = tops[i] if i < len(tops) and tops[i] else []
        content.append({
            "token": text or "", "logprob": lp, "bytes": _bytes(text),
            "top_logprobs": [{"token": t or "", "logprob": v, "bytes": _bytes(t)} for v, _, t in row],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[list[Any]], tops: list[Any], with_top: bool,
                        offset: int) -> dict[str, Any]:
    tokens, token_logprobs, text_offset, top_logprobs = [], [], [], []
    for i, (lp, _, text) in enumerate(entries):
        tokens.append(text or "")
        token_logprobs.append(lp)
        text_offset.append(offset)
        offset += len(text or "")
        row = tops[i] if i < len(tops) and tops[i] else []
        top_logprobs.append({t or "": v for v, _, t in row})
    return {
        "tokens": tokens, "token_logprobs": token_logprobs, "text_offset": text_offset,
        "top_logprobs": top_logprobs if with_top else None,
    }


def completion_entries(out: dict[str, Any], echo: bool) -> tuple[list[Any], list[Any]]:
    meta = out["meta_info"]
    entries = list(meta.get("output_token_logprobs") or [])
    tops = list(meta.get("output_top_logprobs") or [])
    if echo:
        entries = list(meta.get("input_token_logprobs") or []) + entries
        tops = list(meta.get("input_top_logprobs") or []) + tops
    return entries, tops
