"""Helpers the tool-calling and client server tests share: the strict openai client of a
server, the health and leak checks after each test, and the scripted reply of fake_stack's
worker."""

from __future__ import annotations

import time
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


def assert_server_idle(url: str, timeout: float = 30) -> None:
    """A real server is healthy and, once its requests have drained (within ``timeout``), holds
    no request state and leaks no KV: ``available + evictable + protected == max_total_tokens``
    with nothing protected, running or waiting."""
    assert_healthy(url, timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/get_server_info", timeout=timeout).json()
        pool = info["kv_pool"]
        if info["num_request_states"] == 0 and pool["num_running"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    assert pool["available"] + pool["evictable"] + pool["protected"] == pool["max_total_tokens"]
    assert pool["protected"] == 0 and pool["num_waiting"] == 0, pool


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


# A function tool in the Responses API's flat shape.
FLAT_WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def agents_weather_tool(cities: list[str]):
    """An OpenAI Agents SDK ``function_tool`` ``get_weather(city)`` recording each city it is
    called with (tracing off: nothing leaves the machine)."""
    from agents import function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"sunny, 21 C in {city}"

    return get_weather


def langchain_chat(url: str, **options: Any):
    """LangChain's ``ChatOpenAI`` on the server at ``url``: greedy, 60 tokens, no retries;
    ``options`` add to or override those."""
    from langchain_openai import ChatOpenAI

    settings = {"temperature": 0, "max_tokens": 60, "max_retries": 0, **options}
    return ChatOpenAI(base_url=url + "/v1", api_key="x", model="default", **settings)


# two strict tools of the model-format tests (enums and bounds a grammar must keep)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
