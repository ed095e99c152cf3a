"""SGLang's pointwise scoring (``POST /v1/score``, ``Engine.score``) on ``token_ids_logprob``.

Each item is scored on its own prompt, ``query + item`` (``item + query`` with ``item_first``):
a prefill-only request (``max_new_tokens`` 0, as SGLang sends it) whose one output row of
``token_ids_logprob`` holds the logprobs of the label ids as the token after the prompt (from
the raw logits, as every logprob of this server). The items' requests go out together; the
scheduler computes a query prefix they share once (in-batch prefix sharing, then the radix
cache). A text query and text items are joined as text and tokenized together, token ids are
joined as lists (SGLang's rules). An item's scores are ``exp(logprob)`` of its labels, or with
``apply_softmax`` a softmax over its labels of ``logprob / temperature``.

Bounds (GenerateError 400s naming the field): at most MAX_SCORE_ITEMS items, MAX_TOKEN_IDS_LOGPROB
labels an item, MAX_SCORE_TOKENS prompt tokens over all items (the query counted in each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from radixlm.srt.managers.request_checks import MAX_TOKEN_IDS_LOGPROB, check_vocab_ids
from radixlm.srt.managers.request_group import GenerateError

MAX_SCORE_ITEMS = 1024
MAX_SCORE_TOKENS = 262_144  # prompt tokens over all items of one request
SCORE_SAMPLING_PARAMS = {"max_new_tokens": 0}  # prefill only: nothing is generated


@dataclass(frozen=True)
class ScoreResult:
    """SGLang's ``ScoreResult``: ``scores[i][j]`` is item i's score of its label j;
    ``token_logprobs`` (when asked for) the raw logprobs behind them. ``cached_tokens``: prompt
    tokens that came from the prefix cache."""

    scores: list[list[float]]
    prompt_tokens: int = 0
    pooled_hidden_states: None = None  # SGLang fills it for classification models only
    token_logprobs: list[list[float]] | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class ScoreJob:
    """A checked scoring request: each item's prompt (texts to tokenize, or token ids) and its
    label ids."""

    prompts: list[str] | list[list[int]]
    labels: list[list[int]]
    is_text: bool
    apply_softmax: bool = False
    temperature: float = 1.0
    return_token_logprobs: bool = False

    def check_query_tokens(self, num_query_tokens: int) -> None:
        """Before the prompts are tokenized: ``num_query_tokens``, a lower bound of the query's
        tokens in each prompt (see :func:`query_core`), repeated in every item's prompt, must
        leave room under MAX_SCORE_TOKENS; else a 400 before the items are tokenized."""
        # a word cut at either end of the core may spell a few more tokens than it does whole
        least = max(num_query_tokens - SCORE_CUT_TOKENS, 0) * len(self.prompts)
        if least > MAX_SCORE_TOKENS:
            raise GenerateError(
                f"the query has at least {num_query_tokens} tokens, repeated in each of the "
                f"{len(self.prompts)} prompts: more than {MAX_SCORE_TOKENS} tokens per request; "
                "send the items in several requests",
                400,
                "items",
            )

    def check_size(self, prompt_ids: list[list[int]]) -> None:
        """The tokenized prompts: none empty, MAX_SCORE_TOKENS in all."""
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise GenerateError(
                    f"item {i} and the query make an empty prompt; send at least one token",
                    400,
                    "items",
                )
        total = sum(len(ids) for ids in prompt_ids)
        if total > MAX_SCORE_TOKENS:
            raise GenerateError(
                f"the {len(prompt_ids)} prompts (query and item each) hold {total} tokens; at "
                f"most {MAX_SCORE_TOKENS} per request: send the items in several requests",
                400,
                "items",
            )

    def result(self, outs: list[dict[str, Any]]) -> ScoreResult:
        """The scores from the items' ``/generate``-shaped outputs, in item order."""
        token_logprobs = [_label_logprobs(out, i) for i, out in enumerate(outs)]
        metas = [out["meta_info"] for out in outs]
        return ScoreResult(
            scores=[
                label_scores(lps, self.apply_softmax, self.temperature) for lps in token_logprobs
            ],
            prompt_tokens=sum(m["prompt_tokens"] for m in metas),
            token_logprobs=token_logprobs if self.return_token_logprobs else None,
            cached_tokens=sum(m.get("cached_tokens", 0) for m in metas),
        )


def _label_logprobs(out: dict[str, Any], i: int) -> list[float]:
    """Item ``i``'s label logprobs: its one output row of ``token_ids_logprob`` (in the labels'
    order). A request aborted before its prefill ended (``/abort_request`` with ``abort_all``,
    ``/pause_generation``) has none: a 503."""
    meta = out["meta_info"]
    rows = meta.get("output_token_ids_logprobs") or [None]
    if rows[0] is None:
        reason = meta.get("finish_reason") or {}
        aborted = reason.get("type") == "abort"
        raise GenerateError(
            f"item {i} was not scored: its request ended with {reason}",
            503 if aborted else 500,
        )
    return [entry[0] for entry in rows[0]]


def label_scores(logprobs: list[float], apply_softmax: bool, temperature: float) -> list[float]:
    """``exp`` of each logprob, or the softmax of ``logprob / temperature`` over the labels
    (shifted by the largest, so a small temperature cannot overflow)."""
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp((lp - top) / temperature) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


SCORE_QUERY_EDGE_CHARS = 256  # a query's ends may merge with an item's tokens when joined
SCORE_CUT_TOKENS = 8  # slack for the words cut at the core's ends


def query_core(query: str) -> str:
    """The part of a text query whose tokens every prompt holds whatever item it is joined
    with: its ends (where the item's text may merge into the query's words) cut off."""
    return query[SCORE_QUERY_EDGE_CHARS:-SCORE_QUERY_EDGE_CHARS]


def check_text_size(query: str, items: list[str], max_token_chars: int) -> None:
    """Before text prompts are built and tokenized: more characters in all than
    MAX_SCORE_TOKENS tokens can spell (the query is repeated in every item's prompt) is a
    400."""
    chars = len(query) * len(items) + sum(len(item) for item in items)
    if chars > MAX_SCORE_TOKENS * max_token_chars:
        raise GenerateError(
            f"the {len(items)} prompts (query and item each) hold {chars} characters, more "
            f"than {MAX_SCORE_TOKENS} tokens can spell; send the items in several requests",
            400,
            "items",
        )


def plan_scores(
    query: Any,
    items: Any,
    label_token_ids: Any,
    *,
    vocab_size: int,
    max_token_chars: int,
    apply_softmax: bool = False,
    item_first: bool = False,
    temperature: float = 1.0,
    return_token_logprobs: bool = False,
) -> ScoreJob:
    """Checks a scoring request's arguments (SGLang's ``score_request`` names and rules) and
    builds each item's prompt (text prompts no longer in all than MAX_SCORE_TOKENS tokens of
    ``max_token_chars`` characters can spell); GenerateError 400 naming the argument."""
    _check_temperature(temperature, apply_softmax)
    if items is None:
        raise GenerateError(
            "items is required: a text, a list of texts or a list of token-id lists", 400, "items"
        )
    item_list = [items] if isinstance(items, str) else items
    if not isinstance(item_list, list):
        raise GenerateError("items must be a text or a list", 400, "items")
    if len(item_list) > MAX_SCORE_ITEMS:
        raise GenerateError(
            f"items has {len(item_list)} entries; at most {MAX_SCORE_ITEMS} per request",
            400,
            "items",
        )
    is_text = all(isinstance(item, str) for item in item_list)
    if query is None:
        query = "" if is_text else []
    labels = _labels(label_token_ids, len(item_list), vocab_size)
    options = dict(
        apply_softmax=apply_softmax,
        temperature=temperature,
        return_token_logprobs=return_token_logprobs,
    )
    if is_text and isinstance(query, str):
        check_text_size(query, item_list, max_token_chars)
        texts = [item + query if item_first else query + item for item in item_list]
        return ScoreJob(texts, labels, True, **options)
    if not isinstance(query, list) or not all(isinstance(item, list) for item in item_list):
        raise GenerateError(
            "query and items must both be text or both be token ids (lists of integers)",
            400,
            "query" if is_text else "items",
        )
    check_vocab_ids(query, vocab_size, "query")
    for i, item in enumerate(item_list):
        check_vocab_ids(item, vocab_size, f"items[{i}]")
    ids = [item + query if item_first else query + item for item in item_list]
    return ScoreJob(ids, labels, False, **options)


def _check_temperature(temperature: Any, apply_softmax: bool) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise GenerateError("temperature must be a number", 400, "temperature")
    if not math.isfinite(temperature) or temperature <= 0:
        raise GenerateError(
            f"temperature must be a finite number greater than 0, got {temperature}",
            400,
            "temperature",
        )
    if temperature != 1 and not apply_softmax:
        raise GenerateError(
            "temperature scales the softmax over the labels: send apply_softmax: true with it "
            "(or leave temperature at 1)",
            400,
            "temperature",
        )


def _labels(label_token_ids: Any, num_items: int, vocab_size: int) -> list[list[int]]:
    """One checked label list per item (a shared list is repeated)."""
    name = "label_token_ids"
    if label_token_ids is None:
        raise GenerateError(
            f"{name} is required: the token ids whose probabilities are scored", 400, name
        )
    if not isinstance(label_token_ids, list) or not label_token_ids:
        raise GenerateError(f"{name} must be a non-empty list of token ids", 400, name)
    if isinstance(label_token_ids[0], list):
        if len(label_token_ids) != num_items:
            raise GenerateError(
                f"{name} has {len(label_token_ids)} lists for {num_items} items; send one list "
                "per item, or one flat list for all",
                400,
                name,
            )
        per_item = label_token_ids
    else:
        per_item = [label_token_ids] * num_items
    for labels in per_item:
        if not isinstance(labels, list) or not labels:
            raise GenerateError(f"{name}: each item needs a non-empty list of ids", 400, name)
        if len(labels) > MAX_TOKEN_IDS_LOGPROB:
            raise GenerateError(
                f"{name} has a list of {len(labels)} ids; at most {MAX_TOKEN_IDS_LOGPROB}",
                400,
                name,
            )
        check_vocab_ids(labels, vocab_size, name)
        if len(set(labels)) != len(labels):
            raise GenerateError(f"{name} must not repeat a token id", 400, name)
    return [list(labels) for labels in per_item]
