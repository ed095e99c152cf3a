"""OpenAI's legacy completions: ``/v1/completions``, its plan (prompts as text or token ids,
``echo``) and its logprobs (vLLM's shape)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.tokenizer_manager import GenerateError, TokenizerManager
from radixlm.srt.server.chat.plan import (
    OpenAIPlan,
    check_counts,
    check_grammar_conflicts,
    check_max_tokens,
    expand,
    finish_reason,
    format_params,
    raw_grammar,
    sampling_params,
    usage,
)
from radixlm.srt.server.http.body import batch_precheck
from radixlm.srt.server.http.deps import caller_namespace, get_tm, json_response
from radixlm.srt.server.http.errors import parse_body
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, STREAM_RESPONSE, json_body
from radixlm.srt.server.http.streaming import ClosingStreamingResponse
from radixlm.srt.server.openai.call import (
    Call,
    ChoiceCursor,
    answered,
    matched_stop,
    open_call,
    prepared_inputs,
    stream_choices,
    stream_options,
)
from radixlm.srt.server.openai.protocol import UNSUPPORTED_COMPLETION, CompletionRequest
from radixlm.srt.server.openai.vllm_compat import translate_vllm_fields

router = APIRouter(responses=ERROR_RESPONSES)


MAX_COMPLETION_LOGPROBS = 5
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _prompt_list(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise GenerateError("prompt is empty", 400, "prompt")
    return [prompt] if isinstance(prompt[0], int) else list(prompt)


async def _completion_prompt(
    tm: TokenizerManager, prompt: str | list[int]
) -> tuple[str, list[int]]:
    """(text, ids) of one prompt; token ids are checked before anything decodes them."""
    if isinstance(prompt, str):
        return prompt, await tm.tokenize_async(prompt)
    tm.check_token_ids(prompt, "prompt")
    if not prompt:
        raise GenerateError("prompt is empty", 400, "prompt")
    return await tm.run_blocking(tm.decode, prompt, False), list(prompt)


async def completion_plan(req: CompletionRequest, tm: TokenizerManager) -> OpenAIPlan:
    prompts = _prompt_list(req.prompt)
    check_counts(req.n, len(prompts))
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise GenerateError(
            f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}",
            400,
            "logprobs",
        )
    check_max_tokens(req.max_tokens, "max_tokens")
    plan = OpenAIPlan(n=req.n, num_prompts=len(prompts))
    return_logprob = req.logprobs is not None
    logprob = (return_logprob, 0 if req.echo and return_logprob else -1, req.logprobs or 0)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    sp = sampling_params(req, max_tokens)
    constraint = format_params(req.response_format, req)
    check_grammar_conflicts(raw_grammar(req), constraint)
    sp.update(constraint)
    for prompt in prompts:
        text, ids = await _completion_prompt(tm, prompt)
        plan.prompt_texts.append(text)
        expand(plan, req, ids, sp, logprob)
    return plan


def completion_logprobs(
    entries: list[list[Any]], tops: list[Any], with_top: bool, offset: int
) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` (as vLLM sends them): per token, the token's display text,
    its logprob, its offset in the choice's text and a dict of alternatives that always holds the
    token itself, after the top ones when ``with_top``. A token without a logprob (the first
    prompt token of an echo) has ``null`` in both."""
    tokens, token_logprobs, text_offset, top_logprobs = [], [], [], []
    for i, (lp, _, text) in enumerate(entries):
        tokens.append(text or "")
        token_logprobs.append(lp)
        text_offset.append(offset)
        offset += len(text or "")
        row = tops[i] if with_top and i < len(tops) and tops[i] else []
        top_logprobs.append(None if lp is None else _alternatives(row, text or "", lp))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "text_offset": text_offset,
        "top_logprobs": top_logprobs,
    }


def _alternatives(row: list[list[Any]], text: str, lp: float) -> dict[str, float]:
    """Display text -> logprob of the top entries, best first, then the token itself if it is
    not among them (so up to ``logprobs + 1`` keys, as OpenAI documents)."""
    alternatives = {t or "": v for v, _, t in row}
    alternatives.setdefault(text, lp)
    return alternatives


def completion_entries(out: dict[str, Any], echo: bool) -> tuple[list[Any], list[Any]]:
    meta = out["meta_info"]
    entries = list(meta.get("output_token_logprobs") or [])
    tops = list(meta.get("output_top_logprobs") or [])
    if echo:
        entries = list(meta.get("input_token_logprobs") or []) + entries
        tops = list(meta.get("input_top_logprobs") or []) + tops
    return entries, tops


def completion_choice(call: Call, i: int, out: dict[str, Any]) -> dict[str, Any]:
    prompt = call.plan.prompt_texts[call.plan.prompt_of(i)]
    logprobs = None
    if call.logprobs:
        entries, tops = completion_entries(out, call.echo)
        offset = 0 if call.echo else len(prompt)
        logprobs = completion_logprobs(entries, tops, call.top_logprobs, offset)
    return {
        "index": i,
        "text": (prompt if call.echo else "") + out["text"],
        "logprobs": logprobs,
        "finish_reason": finish_reason(out),
        "matched_stop": matched_stop(out),
    }


def completion_chunks(call: Call, i: int, out: dict[str, Any], cur: ChoiceCursor) -> list[dict]:
    reason = finish_reason(out)
    prompt = call.plan.prompt_texts[call.plan.prompt_of(i)]
    text = out["text"][cur.num_chars :]
    entries, tops = completion_entries(out, call.echo) if call.logprobs else ([], [])
    entries, tops = entries[cur.num_logprobs :], tops[cur.num_logprobs :]
    if cur.started and not text and not entries and reason is None:
        return []
    if not cur.started:
        cur.text_offset = 0 if call.echo else len(prompt)
        text = (prompt if call.echo else "") + text
    logprobs = None
    if call.logprobs:
        logprobs = completion_logprobs(entries, tops, call.top_logprobs, cur.text_offset)
        cur.text_offset += sum(len(e[2] or "") for e in entries)
    cur.started, cur.num_chars = True, len(out["text"])
    cur.num_logprobs += len(entries)
    choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
    if reason is not None:
        choice["matched_stop"] = matched_stop(out)
    return [call.envelope([choice], **({"usage": None} if call.include_usage else {}))]


def completion_precheck(tm: TokenizerManager) -> Callable[[dict[str, Any]], None]:
    """vLLM's structured-output fields read as ours, then the batch sizes."""
    batch = batch_precheck(tm)

    def check(data: dict[str, Any]) -> None:
        translate_vllm_fields(data)
        batch(data)

    return check


@router.post(
    "/v1/completions", openapi_extra=json_body(CompletionRequest), responses=STREAM_RESPONSE
)
async def completions(request: Request) -> Response:
    body = await parse_body(
        request, CompletionRequest, UNSUPPORTED_COMPLETION, completion_precheck(get_tm(request))
    )
    tm, model = open_call(request, body.model)
    plan = await completion_plan(body, tm)
    prepared = await prepared_inputs(tm, plan, "max_tokens", "prompt", request)
    call = Call(
        tm,
        plan,
        f"cmpl-{uuid.uuid4().hex}",
        int(time.time()),
        model,
        "text_completion",
        echo=body.echo,
        logprobs=body.logprobs is not None,
        top_logprobs=bool(body.logprobs),
        **stream_options(body),
    )
    group = tm.open(prepared, request, caller_namespace(request, body.user))
    if body.stream:
        updates = await answered(group, body, stream=True)
        return ClosingStreamingResponse(
            stream_choices(call, group, completion_chunks, updates), group.close
        )
    outs = await answered(group, body, stream=False)
    choices = [completion_choice(call, i, out) for i, out in enumerate(outs)]
    return json_response(call.envelope(choices, usage=usage(outs, plan)))
