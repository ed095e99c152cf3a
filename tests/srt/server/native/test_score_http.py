"""SGLang's ``POST /v1/score`` through the HTTP process over fake_stack's worker: the prompts
and prefill-only requests it sends, SGLang's ``ScoringResponse`` shape, the score arithmetic
(the worker's label logprobs are ``-5 - 0.01 t``: fake_stack.fake_id_logprob), and the 400s
and 404 in OpenAI's error shape. On the real default model: the slow test at the end."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
from fake_stack import FakeStack, fake_id_logprob

from radixlm.srt.managers import scoring

LABELS = [30, 31, 45]
QUERY = "Is it true? "


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/score", json=body, timeout=120)


def ok(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = post(url, body)
    assert r.status_code == 200, r.text
    return r.json()


def error_of(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]


def sent(stack: FakeStack, num: int) -> list[Any]:
    """The last ``num`` requests the worker got."""
    return list(stack.worker.received.values())[-num:]


def softmax(values: list[float], temperature: float = 1.0) -> list[float]:
    weights = [math.exp(v / temperature) for v in values]
    return [w / sum(weights) for w in weights]


def test_response_shape_and_probabilities(idle_stack: FakeStack) -> None:
    out = ok(idle_stack.url, {"query": QUERY, "items": ["yes", "no"], "label_token_ids": LABELS})
    assert set(out) == {
        "scores",
        "pooled_hidden_states",
        "token_logprobs",
        "model",
        "usage",
        "object",
    }
    assert out["object"] == "scoring" and out["model"] == "fake-model"
    assert out["pooled_hidden_states"] is None and out["token_logprobs"] is None
    want = [math.exp(fake_id_logprob(t)) for t in LABELS]
    assert out["scores"] == [pytest.approx(want)] * 2
    tok = idle_stack.tokenizer
    reqs = sent(idle_stack, 2)
    assert [r.input_ids for r in reqs] == [tok.encode(QUERY + "yes"), tok.encode(QUERY + "no")]
    for r in reqs:
        assert r.sampling_params["max_new_tokens"] == 0 and r.return_logprob
        assert r.token_ids_logprob == LABELS and r.logprob_start_len == -1
    prompt = sum(len(r.input_ids) for r in reqs)
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == prompt
    assert out["usage"]["completion_tokens"] == 0
    assert set(out["usage"]) >= {"prompt_tokens_details", "reasoning_tokens"}


def test_softmax_temperature_and_token_logprobs(idle_stack: FakeStack) -> None:
    body = {
        "query": QUERY,
        "items": "yes",
        "label_token_ids": LABELS,
        "apply_softmax": True,
        "temperature": 0.05,
        "return_token_logprobs": True,
        "model": "default",
    }
    out = ok(idle_stack.url, body)
    logprobs = [fake_id_logprob(t) for t in LABELS]
    assert out["token_logprobs"] == [pytest.approx(logprobs)]
    (row,) = out["scores"]
    assert row == pytest.approx(softmax(logprobs, 0.05)) and sum(row) == pytest.approx(1)
    assert out["model"] == "default"


def test_token_ids_item_first_and_labels_per_item(idle_stack: FakeStack) -> None:
    body = {
        "query": [5, 6],
        "items": [[7], [8, 9]],
        "label_token_ids": [[30], [31, 32]],
        "item_first": True,
        "apply_softmax": True,
    }
    out = ok(idle_stack.url, body)
    assert [r.input_ids for r in sent(idle_stack, 2)] == [[7, 5, 6], [8, 9, 5, 6]]
    assert [r.token_ids_logprob for r in sent(idle_stack, 2)] == [[30], [31, 32]]
    assert out["scores"][0] == [1.0]
    want = softmax([fake_id_logprob(31), fake_id_logprob(32)])
    assert out["scores"][1] == pytest.approx(want)
    text_first = ok(
        idle_stack.url, {"query": "Q", "items": ["a"], "label_token_ids": [30], "item_first": True}
    )
    assert sent(idle_stack, 1)[0].input_ids == idle_stack.tokenizer.encode("aQ")
    assert len(text_first["scores"]) == 1


def test_no_items_no_work(idle_stack: FakeStack) -> None:
    before = len(idle_stack.worker.received)
    out = ok(idle_stack.url, {"query": "q", "items": [], "label_token_ids": [1]})
    assert out["scores"] == [] and out["usage"]["prompt_tokens"] == 0
    assert len(idle_stack.worker.received) == before


def test_unknown_fields_are_ignored_unsupported_ones_refused(idle_stack: FakeStack) -> None:
    base = {"query": "q", "items": ["a"], "label_token_ids": [30]}
    assert post(idle_stack.url, {**base, "user": "x", "whatever": 1}).status_code == 200
    off = {
        "embed_override_token_id": None,
        "query_embed_overrides": None,
        "item_embed_overrides": None,
        "return_pooled_hidden_states": False,
        "score_extraction_token": None,
    }
    assert post(idle_stack.url, {**base, **off}).status_code == 200
    for name, value in [
        ("embed_override_token_id", 3),
        ("query_embed_overrides", [[0.5]]),
        ("item_embed_overrides", [None]),
        ("return_pooled_hidden_states", True),
        ("score_extraction_token", "<s>"),
    ]:
        err = error_of(post(idle_stack.url, {**base, name: value}))
        assert err["param"] == name and err["code"] == "unsupported_parameter", err
        assert name in err["message"]


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"items": None}, "items", "required"),
        ({"label_token_ids": None}, "label_token_ids", "required"),
        ({"label_token_ids": []}, "label_token_ids", "non-empty"),
        ({"label_token_ids": [30, 30]}, "label_token_ids", "repeat"),
        ({"label_token_ids": [10**6]}, "label_token_ids", "[0, "),
        ({"label_token_ids": [[30], [31]]}, "label_token_ids", "2 lists for 1 items"),
        ({"items": ["a", "b"], "label_token_ids": [[30], []]}, "label_token_ids", "non-empty"),
        ({"query": [1, 2]}, "query", "both be text or both be token ids"),
        ({"items": [[1]]}, "items", "both be text or both be token ids"),
        ({"query": [10**6], "items": [[1]]}, "query", "[0, "),
        ({"temperature": 2.0}, "temperature", "apply_softmax"),
        ({"temperature": 0.0, "apply_softmax": True}, "temperature", "greater than 0"),
        ({"temperature": -1, "apply_softmax": True}, "temperature", "greater than 0"),
        ({"items": ["a"] * 1025}, "items", "at most 1024"),
        ({"query": "", "items": [""]}, "items", "empty prompt"),
        ({"apply_softmax": "yes"}, "apply_softmax", ""),
    ],
)
def test_refusals(idle_stack: FakeStack, change: dict, param: str, words: str) -> None:
    body = {"query": "q", "items": ["a"], "label_token_ids": [30], **change}
    err = error_of(post(idle_stack.url, {k: v for k, v in body.items() if v is not None}))
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_unknown_model_is_a_404(idle_stack: FakeStack) -> None:
    body = {"query": "q", "items": ["a"], "label_token_ids": [30], "model": "other"}
    err = error_of(post(idle_stack.url, body), 404)
    assert err["code"] == "model_not_found"


def test_total_tokens_are_bounded(idle_stack: FakeStack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scoring, "MAX_SCORE_TOKENS", 10)
    body = {"query": [1, 2, 3], "items": [[4, 5], [6, 7]], "label_token_ids": [30]}
    assert post(idle_stack.url, body).status_code == 200  # 10 tokens
    err = error_of(post(idle_stack.url, {**body, "items": [[4, 5], [6, 7, 8]]}))
    assert err["param"] == "items" and "at most 10" in err["message"]
    err = error_of(
        post(idle_stack.url, {"query": "q" * 2000, "items": ["a"], "label_token_ids": [1]})
    )
    assert err["param"] == "items" and "characters" in err["message"]


# ---------------------------------------------------------------------- the default model
@pytest.mark.slow
def test_scores_on_the_default_model(idle_server) -> None:
    """Against the model's own input logprobs of each label after each prompt (another code
    path: /generate's input logprobs of prompt + label), over HTTP on `radixlm serve`."""
    url = idle_server.url
    query = "<|im_start|>user\nIs Paris the capital of France? Answer yes or no.<|im_end|>\n"
    items = ["<|im_start|>assistant\n", "<|im_start|>assistant\nThe answer:"]
    tok = httpx.post(url + "/tokenize", json={"prompt": [" yes", " no", "Yes"]}).json()
    labels = [ids[0] for ids in tok["tokens"]]
    body = {"query": query, "items": items, "label_token_ids": labels}
    raw, soft = ok(url, body), ok(url, {**body, "apply_softmax": True})
    for i, item in enumerate(items):
        prompt = httpx.post(url + "/tokenize", json={"prompt": query + item}).json()["tokens"]
        want = []
        for label in labels:
            gen = {
                "input_ids": prompt + [label],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": len(prompt),
            }
            r = httpx.post(url + "/generate", json=gen, timeout=120).json()
            want.append(math.exp(r["meta_info"]["input_token_logprobs"][0][0]))
        assert raw["scores"][i] == pytest.approx(want, rel=1e-3, abs=1e-6)
        assert soft["scores"][i] == pytest.approx([w / sum(want) for w in want], rel=1e-3)
        assert sum(soft["scores"][i]) == pytest.approx(1.0)
    assert raw["usage"]["prompt_tokens"] > 0
