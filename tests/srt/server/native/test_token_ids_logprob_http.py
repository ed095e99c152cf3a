"""SGLang's ``token_ids_logprob`` on ``/generate`` through the HTTP process, over fake_stack's
worker: what reaches the scheduler, the ``meta_info`` shape (one row per position of
``(logprob, token_id, text)`` for exactly the requested ids, texts with
``return_text_in_logprobs``), batches with shared and per-prompt lists, streams, and the 400s.
The worker gives the chosen token the logprob ``output_token_logprobs`` shows, any other id t
``-5 - 0.01 t`` (fake_stack.id_row). Values on the real model: tests/srt/scheduler/
test_token_ids_logprob.py and tests/srt/engine/test_engine_scoring.py."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from fake_stack import FakeStack, fake_id_logprob

from radixlm.srt.managers.request_checks import MAX_TOKEN_IDS_LOGPROB

IDS = [40, 7, 250]
MANY = [i % 250 for i in range(MAX_TOKEN_IDS_LOGPROB)]  # the fake vocabulary has 292 ids


def post(stack: FakeStack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(stack.url + "/generate", json=body, timeout=30)


def ok(stack: FakeStack, body: dict[str, Any]) -> Any:
    r = post(stack, body)
    assert r.status_code == 200, r.text
    return r.json()


def error_of(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def _ids_body(prompt: str = "hello world", **extra: Any) -> dict[str, Any]:
    return {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 4},
        "return_logprob": True,
        "token_ids_logprob": IDS,
        **extra,
    }


def _check_row(row: list[list[Any]], chosen: int | None, chosen_lp: float | None) -> None:
    assert [e[1] for e in row] == IDS
    for lp, t, text in row:
        assert text is None
        assert lp == pytest.approx(chosen_lp if t == chosen else fake_id_logprob(t))


def test_rows_hold_exactly_the_requested_ids(idle_stack: FakeStack) -> None:
    out = ok(idle_stack, _ids_body(logprob_start_len=1))
    meta = out["meta_info"]
    sent = list(idle_stack.worker.received.values())[-1]
    assert sent.token_ids_logprob == IDS and sent.return_logprob
    outputs = meta["output_token_ids_logprobs"]
    assert len(outputs) == len(meta["output_token_logprobs"]) == 4
    for row, (lp, tok, _) in zip(outputs, meta["output_token_logprobs"], strict=True):
        _check_row(row, tok, lp)
    inputs = meta["input_token_ids_logprobs"]
    assert len(inputs) == len(meta["input_token_logprobs"]) == len(sent.input_ids) - 1
    for row, (_, tok, _) in zip(inputs, meta["input_token_logprobs"], strict=True):
        _check_row(row, tok, -1.0)


def test_first_prompt_position_is_null(idle_stack: FakeStack) -> None:
    meta = ok(idle_stack, _ids_body(logprob_start_len=0))["meta_info"]
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_token_ids_logprobs"][0] is None
    assert all(row is not None for row in meta["input_token_ids_logprobs"][1:])


def test_texts_with_return_text_in_logprobs(idle_stack: FakeStack) -> None:
    meta = ok(idle_stack, _ids_body(return_text_in_logprobs=True))["meta_info"]
    decode = idle_stack.tokenizer.decode
    for row in meta["output_token_ids_logprobs"]:
        assert [e[2] for e in row] == [decode([t]) for t in IDS]


def test_keys_only_when_asked_for(idle_stack: FakeStack) -> None:
    plain = ok(idle_stack, {**_ids_body(), "token_ids_logprob": None})["meta_info"]
    assert "output_token_ids_logprobs" not in plain and "input_token_ids_logprobs" not in plain
    empty = ok(idle_stack, {**_ids_body(), "token_ids_logprob": []})["meta_info"]
    assert "output_token_ids_logprobs" not in empty
    # without return_logprob the ids have no effect (as SGLang): no logprob keys at all
    off = ok(idle_stack, {**_ids_body(), "return_logprob": False})["meta_info"]
    assert "output_token_ids_logprobs" not in off
    assert list(idle_stack.worker.received.values())[-1].token_ids_logprob is None


def test_input_rows_without_input_logprobs_are_empty(idle_stack: FakeStack) -> None:
    meta = ok(idle_stack, _ids_body())["meta_info"]  # logprob_start_len -1: no input positions
    assert meta["input_token_ids_logprobs"] == [] and len(meta["output_token_ids_logprobs"]) == 4


def test_prefill_only_gets_one_row(idle_stack: FakeStack) -> None:
    body = {**_ids_body(), "sampling_params": {"max_new_tokens": 0}}
    out = ok(idle_stack, body)
    assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
    (row,) = out["meta_info"]["output_token_ids_logprobs"]
    _check_row(row, None, None)


def test_batches_shared_and_per_prompt(idle_stack: FakeStack) -> None:
    shared = ok(idle_stack, _ids_body(prompt=["a b", "c d"]))
    for out in shared:
        assert [e[1] for e in out["meta_info"]["output_token_ids_logprobs"][0]] == IDS
    per_prompt = ok(idle_stack, _ids_body(prompt=["a b", "c d"], token_ids_logprob=[[5], None]))
    assert [e[1] for e in per_prompt[0]["meta_info"]["output_token_ids_logprobs"][0]] == [5]
    assert "output_token_ids_logprobs" not in per_prompt[1]["meta_info"]
    first_none = ok(idle_stack, _ids_body(prompt=["a b", "c d"], token_ids_logprob=[None, [6]]))
    assert "output_token_ids_logprobs" not in first_none[0]["meta_info"]
    assert [e[1] for e in first_none[1]["meta_info"]["output_token_ids_logprobs"][0]] == [6]
    with_n = {**_ids_body(prompt=["a", "b"], token_ids_logprob=[[5], [6, 7]])}
    with_n["sampling_params"] = {"max_new_tokens": 1, "n": 2}
    outs = ok(idle_stack, with_n)
    rows = [[e[1] for e in o["meta_info"]["output_token_ids_logprobs"][0]] for o in outs]
    assert rows == [[5], [5], [6, 7], [6, 7]]


def test_stream_carries_the_rows_so_far(idle_stack: FakeStack) -> None:
    body = _ids_body(stream=True)
    with httpx.stream("POST", idle_stack.url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [len(e["meta_info"]["output_token_ids_logprobs"]) for e in events]
    assert counts == sorted(counts) and counts[-1] == 4


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([1, 10**6], "[0, "),
        ([-1], "[0, "),
        ([*MANY, 1], f"at most {MAX_TOKEN_IDS_LOGPROB}"),
        ([[1], [2]], "2 lists for 1 prompts"),
        (["7"], "token_ids_logprob"),
        ([True], "token_ids_logprob"),
        ([1, [2]], "token_ids_logprob"),
    ],
)
def test_refusals_name_the_field(idle_stack: FakeStack, value: Any, words: str) -> None:
    err = error_of(post(idle_stack, {**_ids_body(), "token_ids_logprob": value}))
    assert err["param"].startswith("token_ids_logprob") and words in err["message"], err


@pytest.mark.slow
def test_largest_requests_pass(idle_stack: FakeStack) -> None:
    """1024 ids at every output position, or every position of a long prompt, pass; more
    than 1024 ids in a per-prompt list is refused before the body is validated."""
    body = {**_ids_body(), "token_ids_logprob": MANY}
    body["sampling_params"] = {"max_new_tokens": 200}
    assert post(idle_stack, body).status_code == 200  # 1024 x 200 values
    body["sampling_params"] = {"max_new_tokens": 4}
    body["input_ids"], body["logprob_start_len"] = [5] * 250, 0
    del body["text"]
    assert post(idle_stack, body).status_code == 200  # 1024 x 254 values
    many = {**body, "text": ["x"] * 20, "token_ids_logprob": [[*MANY, 1]] + [None] * 19}
    del many["input_ids"]
    assert error_of(post(idle_stack, many))["param"] == "token_ids_logprob"


def test_bound_on_values(idle_stack: FakeStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The logprob values one request may ask for (positions x ids), here lowered to 100."""
    from radixlm.srt.managers import request_checks

    monkeypatch.setattr(request_checks, "MAX_TOKEN_IDS_LOGPROB_VALUES", 100)
    body = {**_ids_body(), "token_ids_logprob": list(range(25))}
    assert post(idle_stack, body).status_code == 200  # 25 ids x 4 new tokens
    err = error_of(post(idle_stack, {**body, "logprob_start_len": 0}))  # + the prompt's
    assert err["param"] == "token_ids_logprob" and "more than 100 values" in err["message"]
