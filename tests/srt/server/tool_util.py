"""Helpers the tool-calling server tests share: the strict openai client of a server, the
health check after each test, and the scripted reply of fake_stack's worker."""

from __future__ import annotations

from typing import Any

import httpx
import openai
from fake_stack import FakeStack


def strict_client(url: str, **options: Any) -> openai.OpenAI:
    """An openai client of the server at ``url`` that checks every response against its models
    and never retries; ``options`` go to ``openai.OpenAI`` (a ``timeout``, say)."""
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
        **options,
    )


def assert_healthy(url: str, timeout: float) -> None:
    assert httpx.get(url + "/health", timeout=timeout).status_code == 200


def assert_idle(stack: FakeStack) -> None:
    """The fake stack is healthy and holds no request any more."""
    assert_healthy(stack.url, timeout=5)
    stack.tm.assert_no_requests()


def reply_with(stack: FakeStack, text: str) -> dict:
    """The worker replies ``text`` then <eos>; the returned extra body stops it there."""
    eos = stack.tokenizer.convert_tokens_to_ids("<eos>")
    stack.worker.cont_ids = stack.tokenizer.encode(text, add_special_tokens=False) + [eos]
    return {"stop_token_ids": [eos]}


def last_params(stack: FakeStack) -> dict:
    """The sampling params of the request the worker received last."""
    return list(stack.worker.received.values())[-1].sampling_params
