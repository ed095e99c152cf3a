"""``/tokenize`` and ``/detokenize`` (SGLang's and vLLM's shapes; lm-eval's remote tokenizer
reads them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.tokenizer_manager import TokenizerManager
from radixlm.srt.server.http.body import MAX_SEQUENCES_PER_REQUEST, batch_precheck, check_list_len
from radixlm.srt.server.http.deps import get_tm, json_response
from radixlm.srt.server.http.errors import parse_body
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, json_body
from radixlm.srt.server.native.protocol import DetokenizeInput, TokenizeInput

router = APIRouter(responses=ERROR_RESPONSES)


def detokenize_precheck(tm: TokenizerManager) -> Callable[[dict[str, Any]], None]:
    """``tokens``: at most MAX_SEQUENCES_PER_REQUEST rows, each no longer than the context
    (what /generate takes as input_ids), so one call's decoding is bounded."""

    def check(data: dict[str, Any]) -> None:
        tokens = data.get("tokens")
        if isinstance(tokens, list) and tokens and isinstance(tokens[0], list):
            check_list_len(tokens, MAX_SEQUENCES_PER_REQUEST, "tokens")
            rows = tokens
        else:
            rows = [tokens]
        for row in rows:
            check_list_len(row, tm.context_length, "tokens")

    return check


@router.post("/tokenize", openapi_extra=json_body(TokenizeInput))
async def tokenize(request: Request) -> Response:
    body = await parse_body(request, TokenizeInput, None, batch_precheck(get_tm(request)))
    tm = get_tm(request)
    prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    tokens = [await tm.tokenize_async(p, body.add_special_tokens) for p in prompts]
    if isinstance(body.prompt, list):
        return json_response(
            {
                "tokens": tokens,
                "count": [len(t) for t in tokens],
                "max_model_len": tm.context_length,
            }
        )
    return json_response(
        {"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": tm.context_length}
    )


@router.post("/detokenize", openapi_extra=json_body(DetokenizeInput))
async def detokenize(request: Request) -> Response:
    tm = get_tm(request)
    body = await parse_body(request, DetokenizeInput, None, detokenize_precheck(tm))
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    rows: list[list[int]] = body.tokens if batch else [body.tokens]  # type: ignore[assignment]
    texts = await tm.decode_rows_async(rows, body.skip_special_tokens)
    out = texts if batch else texts[0]
    # "text" is SGLang's key, "prompt" vLLM's (lm-eval's remote tokenizer reads that one)
    return json_response({"text": out, "prompt": out})
