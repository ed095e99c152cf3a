"""End to end: agent frameworks drive tool calling on `radixlm serve` (default model) through
their own OpenAI clients: LangChain's ``bind_tools`` and ``with_structured_output(method=
"function_calling")``, and the OpenAI Agents SDK's tool loop. Each tool function is really
called with arguments valid against its schema, and each run ends with an answer."""

from __future__ import annotations

import jsonschema
import plain_http
import pytest
from pydantic import BaseModel, Field
from tool_util import agents_weather_tool, langchain_chat

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(default_server) -> ServerProcess:
    return default_server


@pytest.fixture(autouse=True)
def _healthy(server: ServerProcess):
    yield
    assert plain_http.get(server.url + "/health", timeout=30).status_code == 200


# ---------------------------------------------------------------------- LangChain
@pytest.fixture(scope="module")
def llm(server: ServerProcess):
    return langchain_chat(server.url, timeout=120)


def make_weather_tool(calls: list[str]):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"sunny, 21 C in {city}"

    return get_weather


@pytest.mark.parametrize("choice", ["get_weather", "required", "any"])
def test_langchain_bind_tools_loop(llm, choice: str) -> None:
    from langchain_core.messages import HumanMessage

    calls: list[str] = []
    get_weather = make_weather_tool(calls)
    question = HumanMessage(QUESTION)
    ai = llm.bind_tools([get_weather], tool_choice=choice).invoke([question])
    (call,) = ai.tool_calls[:1]
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())
    result = get_weather.invoke(call)  # a ToolMessage answering the call
    assert calls == [call["args"]["city"]]
    final = llm.bind_tools([get_weather], tool_choice="none").invoke([question, ai, result])
    assert not final.tool_calls and isinstance(final.content, str) and final.content
    assert "tool_calls" not in final.content, final.content  # an answer, not a call written out


def test_langchain_streamed_tool_call(llm) -> None:
    calls: list[str] = []
    get_weather = make_weather_tool(calls)
    chunks = list(llm.bind_tools([get_weather], tool_choice="get_weather").stream(QUESTION))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    (call,) = merged.tool_calls[:1]
    assert call["name"] == "get_weather"
    get_weather.invoke(call)
    assert calls == [call["args"]["city"]]


class Forecast(BaseModel):
    """A forecast for one city."""

    city: str = Field(max_length=30)
    degrees_celsius: int = Field(ge=-50, le=60)


def test_langchain_structured_output_by_function_calling(llm) -> None:
    structured = llm.with_structured_output(Forecast, method="function_calling")
    out = structured.invoke("Give a forecast for Paris.")
    assert isinstance(out, Forecast)
    raw = llm.with_structured_output(Forecast, method="function_calling", include_raw=True)
    result = raw.invoke("Give a forecast for Rome.")
    assert result["parsing_error"] is None and isinstance(result["parsed"], Forecast)


# ---------------------------------------------------------------------- OpenAI Agents SDK
def test_agents_sdk_tool_loop(server: ServerProcess) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner
    from openai import AsyncOpenAI

    calls: list[str] = []
    get_weather = agents_weather_tool(calls)

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    agent = Agent(
        name="weather",
        instructions="Answer weather questions. Call get_weather, then answer in one sentence.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="default", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    result = Runner.run_sync(agent, QUESTION, max_turns=4)
    assert calls, "the tool was never called"
    answer = result.final_output
    assert isinstance(answer, str) and answer.strip() and "tool_calls" not in answer, answer
