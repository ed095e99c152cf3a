"""``/health_generate``: SGLang's health check that generates one token (``/health`` answers
without the scheduler: app.py)."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.tokenizer_manager import GenerateError, GenerateInput
from radixlm.srt.server.http.deps import get_tm, json_response
from radixlm.srt.server.http.openapi import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)


def _health_check_timeout_s() -> float:
    """SGLang waits 20 s too (its SGLANG_HEALTH_CHECK_TIMEOUT); RADIXLM_HEALTH_CHECK_TIMEOUT
    changes it (seconds, a positive number)."""
    text = os.environ.get("RADIXLM_HEALTH_CHECK_TIMEOUT", "20")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(
            f"RADIXLM_HEALTH_CHECK_TIMEOUT must be a positive number of seconds, not {text!r}"
        )
    return value


HEALTH_GENERATE_TIMEOUT_S = _health_check_timeout_s()


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    try:  # on timeout the cancelled request is aborted in the scheduler
        return await asyncio.wait_for(_generate_one_token(request), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise GenerateError(
            f"the scheduler did not generate a token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503
        ) from None


async def _generate_one_token(request: Request) -> Response:
    tm = get_tm(request)
    inp = GenerateInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    with tm.open([await tm.prepare(inp)], request) as group:
        out = await group.collect()
    return json_response(
        {"status": "ok", "completion_tokens": out[0]["meta_info"]["completion_tokens"]}
    )
