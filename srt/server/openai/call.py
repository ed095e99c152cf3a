"""What a chat or a completion call of the OpenAI API shares: the call's envelope, its options,
its requests sent, and the stream of choices."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from radixlm.srt.managers.tokenizer_manager import (
    ClientDisconnected,
    GenerateError,
    RequestGroup,
    TokenizerManager,
)
from radixlm.srt.server.chat.plan import OpenAIPlan, name_grammar_error, usage
from radixlm.srt.server.chat.tool_stream import ChoiceStream
from radixlm.srt.server.http.deps import check_model, get_tm, take_routing_key
from radixlm.srt.server.http.errors import sse_error
from radixlm.srt.server.http.streaming import SSE_DONE, Updates, sse, started_updates


@dataclass
class Call:
    """What every response piece of one OpenAI call shares."""

    tm: TokenizerManager
    plan: OpenAIPlan
    id: str
    created: int
    model: str
    object: str
    echo: bool = False
    logprobs: bool = False
    top_logprobs: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


@dataclass
class ChoiceCursor:
    """How much of one choice a stream has sent."""

    num_chars: int = 0
    num_logprobs: int = 0
    text_offset: int = 0
    started: bool = False
    parsers: ChoiceStream | None = None  # chat: this choice's tool-call / reasoning parsers


def matched_stop(out: dict[str, Any]) -> Any:
    reason = out["meta_info"]["finish_reason"] or {}
    return reason.get("matched")


def stream_options(body: Any) -> dict[str, bool]:
    """The ``Call`` fields ``stream_options`` sets; a 400 without ``stream: true`` (OpenAI
    and vLLM refuse it there too)."""
    options = body.stream_options
    if options is None:
        return {}
    if not body.stream:
        raise GenerateError(
            "stream_options is only allowed with stream: true", 400, "stream_options"
        )
    return {
        "include_usage": options.include_usage,
        "continuous_usage": options.continuous_usage_stats,
    }


async def prepared_inputs(
    tm: TokenizerManager, plan: Any, limit: str, prompt: str, request: Request | None = None
) -> list[Any]:
    """``tm.prepare_all`` whose errors name the OpenAI fields: ``limit`` for the native
    ``max_new_tokens``, ``prompt`` for a prompt that is empty or too long; ``request``'s
    routing key header read (:func:`take_routing_key`)."""
    take_routing_key(plan.inputs, request)
    try:
        return await tm.prepare_all(plan.inputs)
    except GenerateError as e:
        if e.param == "max_new_tokens":
            e.param = limit
            e.message = e.message.replace("max_new_tokens", limit)
        elif e.param is None and e.message.startswith("the prompt"):
            e.param = prompt
        raise


def open_call(request: Request, model: str | None) -> tuple[TokenizerManager, str]:
    state = request.app.state
    check_model(model, state.accepted_model_names, state.served_model_name)
    return get_tm(request), model or state.served_model_name


async def answered(group: RequestGroup, body: Any, *, stream: bool) -> Any:
    """The group's started updates (``stream``) or its collected outputs; a grammar's 400
    (it did not compile) names the OpenAI request field it came from."""
    try:
        if stream:
            return await started_updates(group)
        with group:
            return await group.collect()
    except GenerateError as e:
        name_grammar_error(e, body)
        raise


def _choice_usage(out: dict[str, Any]) -> dict[str, int]:
    """One choice's usage so far (``continuous_usage_stats``, as SGLang counts it)."""
    meta = out["meta_info"]
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


ChunkFn = Callable[[Call, int, dict[str, Any], ChoiceCursor], "list[dict]"]


async def stream_choices(
    call: Call, group: RequestGroup, make_chunk: ChunkFn, updates: Updates
) -> AsyncIterator[bytes]:
    """One chunk per update of any choice (from ``updates``: :func:`started_updates`), one
    ``finish_reason`` per choice, then the usage chunk (when asked for) and ``[DONE]``; an
    error after the first update becomes an error event."""
    cursors = [ChoiceCursor() for _ in group.states]
    finals: list[dict[str, Any]] = [{} for _ in group.states]
    try:
        async for i, out in updates:
            for chunk in make_chunk(call, i, out, cursors[i]):
                if call.continuous_usage:
                    chunk["usage"] = _choice_usage(out)
                yield sse(chunk)
            finals[i] = out
        if call.include_usage:
            yield sse(call.envelope([], usage=usage(finals, call.plan)))
    except GenerateError as e:
        yield sse_error(e)
    except ClientDisconnected:
        return
    finally:
        group.close()
    yield SSE_DONE
