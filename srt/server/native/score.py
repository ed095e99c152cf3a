"""SGLang's scoring route, ``POST /v1/score`` (managers/scoring.py does the work).

The body is SGLang's ``ScoringRequest``; as on the other OpenAI-compatible routes, unknown
fields are ignored, and SGLang's fields this server does not implement (``UNSUPPORTED_SCORE``:
embedding overrides, pooled hidden states of classification models, setwise readout) are a 400
naming them unless they hold their off value. The answer is SGLang's ``ScoringResponse``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.request_checks import MAX_TOKEN_IDS_LOGPROB
from radixlm.srt.managers.scoring import (
    MAX_SCORE_ITEMS,
    SCORE_SAMPLING_PARAMS,
    ScoreResult,
    plan_scores,
    query_core,
)
from radixlm.srt.managers.tokenizer_manager import GenerateInput
from radixlm.srt.server.http.body import StrictBody, check_list_len
from radixlm.srt.server.http.deps import check_model, get_tm, json_response
from radixlm.srt.server.http.errors import parse_body
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, json_body

router = APIRouter(responses=ERROR_RESPONSES)

UNSUPPORTED_SCORE = {
    "embed_override_token_id": (None,),
    "query_embed_overrides": (None,),
    "item_embed_overrides": (None,),
    "stacked_query_item_embed_overrides": (None,),
    "return_pooled_hidden_states": (None, False),
    "score_extraction_token": (None,),
}


class ScoringRequest(StrictBody):
    """SGLang's ``ScoringRequest`` (the fields this server implements)."""

    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | list[list[int]] | None = None
    apply_softmax: bool = False
    temperature: float = 1.0
    return_token_logprobs: bool = False
    item_first: bool = False
    model: str | None = None


def precheck_score(data: dict[str, Any], context_length: int) -> None:
    """Sizes before the body is validated: items and label lists, token-id prompts."""
    items, labels = data.get("items"), data.get("label_token_ids")
    check_list_len(items, MAX_SCORE_ITEMS, "items")
    check_list_len(data.get("query"), context_length, "query")
    if isinstance(items, list):
        for item in items:
            check_list_len(item, context_length, "items")
    check_list_len(labels, max(MAX_SCORE_ITEMS, MAX_TOKEN_IDS_LOGPROB), "label_token_ids")
    if isinstance(labels, list):
        for row in labels:
            check_list_len(row, MAX_TOKEN_IDS_LOGPROB, "label_token_ids")


def scoring_response(result: ScoreResult, model: str) -> dict[str, Any]:
    """SGLang's ``ScoringResponse`` (with its ``UsageInfo``) as a dict."""
    return {
        "scores": result.scores,
        "pooled_hidden_states": result.pooled_hidden_states,
        "token_logprobs": result.token_logprobs,
        "model": model,
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "total_tokens": result.prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        },
        "object": "scoring",
    }


@router.post("/v1/score", openapi_extra=json_body(ScoringRequest))
async def score(request: Request) -> Response:
    """The probability of each label token after each ``query + item`` prompt."""
    tm = get_tm(request)
    body: ScoringRequest = await parse_body(
        request,
        ScoringRequest,
        UNSUPPORTED_SCORE,
        lambda data: precheck_score(data, tm.context_length),
    )
    state = request.app.state
    check_model(body.model, state.accepted_model_names, state.served_model_name)
    job = plan_scores(
        body.query,
        body.items,
        body.label_token_ids,
        vocab_size=tm.vocab_size,
        max_token_chars=tm.door.max_token_chars,
        apply_softmax=body.apply_softmax,
        item_first=body.item_first,
        temperature=body.temperature,
        return_token_logprobs=body.return_token_logprobs,
    )
    if job.is_text and isinstance(body.query, str) and len(job.prompts) > 1:
        # pre-count: the query's tokens (once) times the items, before every prompt is
        # tokenized (a long query in a thousand prompts is seconds of tokenizing)
        core = await tm.tokenize_async(query_core(body.query), False, "query")
        job.check_query_tokens(len(core))
    if job.is_text:
        prompt_ids = [await tm.tokenize_async(t, param="items") for t in job.prompts]
    else:
        prompt_ids = job.prompts
    job.check_size(prompt_ids)
    inputs = [
        GenerateInput(
            input_ids=ids,
            sampling_params=SCORE_SAMPLING_PARAMS,
            return_logprob=True,
            token_ids_logprob=labels,
        )
        for ids, labels in zip(prompt_ids, job.labels, strict=True)
    ]
    outs: list[dict[str, Any]] = []
    if inputs:
        with tm.open(await tm.prepare_all(inputs), request) as group:
            outs = await group.collect()
    return json_response(scoring_response(job.result(outs), body.model or state.served_model_name))
