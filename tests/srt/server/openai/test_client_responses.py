"""End to end: the Responses API on `radixlm serve` (default model) through real clients: the
openai package's ``responses.create`` / ``.stream`` / ``.parse`` and a conversation continued
with ``previous_response_id``; the OpenAI Agents SDK's default model (``OpenAIResponsesModel``):
a function tool really called with valid arguments, streamed runs, structured output;
pydantic-ai's ``OpenAIResponsesModel`` and LangChain's ``ChatOpenAI(use_responses_api=True)``
(forced and streamed tool calls, structured output)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from tool_util import FLAT_WEATHER_TOOL, agents_weather_tool, langchain_chat

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = FLAT_WEATHER_TOOL
QUESTION = "What is the weather in Paris?"
OPTIONS = {"model": "default", "temperature": 0, "max_output_tokens": 60}


class CityWeather(BaseModel):
    city: str
    sunny: bool


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
    )


def test_text_and_a_continued_conversation(idle_server: ServerProcess) -> None:
    c = client(idle_server)
    first = c.responses.create(input="Name a fruit.", **OPTIONS)
    assert first.status in ("completed", "incomplete") and first.output_text
    second = c.responses.create(input="Name another one.", previous_response_id=first.id, **OPTIONS)
    assert second.output_text and second.previous_response_id == first.id
    # the second prompt held the first turn: its cached prefix covers it
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call(idle_server: ServerProcess, stream: bool) -> None:
    c = client(idle_server)
    if stream:
        with c.responses.stream(
            input=QUESTION, tools=[WEATHER], tool_choice="required", **OPTIONS
        ) as events:
            for _ in events:
                pass
            response = events.get_final_response()
    else:
        response = c.responses.create(
            input=QUESTION, tools=[WEATHER], tool_choice="required", **OPTIONS
        )
    calls = [o for o in response.output if o.type == "function_call"]
    assert calls  # "required": one call or more (parallel calls are allowed)
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_parse_with_a_pydantic_format(idle_server: ServerProcess) -> None:
    parsed = client(idle_server).responses.parse(
        input="Paris: sunny.", text_format=CityWeather, **OPTIONS
    )
    assert isinstance(parsed.output_parsed, CityWeather)


def test_agents_sdk_default_model(idle_server: ServerProcess) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner

    cities: list[str] = []
    get_weather = agents_weather_tool(cities)

    async def run() -> tuple[str, str, CityWeather]:
        raw = openai.AsyncOpenAI(base_url=idle_server.url + "/v1", api_key="x", max_retries=0)
        model = OpenAIResponsesModel(model="default", openai_client=raw)
        settings = ModelSettings(tool_choice="required", max_tokens=80, temperature=0)
        caller = Agent(
            name="weather",
            instructions="Use the tool.",
            model=model,
            tools=[get_weather],
            model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )
        plain = await Runner.run(caller, QUESTION)
        streamed = Runner.run_streamed(caller, "What is the weather in Rome?")
        async for _ in streamed.stream_events():
            pass
        structured = Agent(
            name="structured",
            model=model,
            output_type=CityWeather,
            model_settings=ModelSettings(max_tokens=80, temperature=0),
        )
        out = await Runner.run(structured, "Paris: sunny.")
        return plain.final_output, streamed.final_output, out.final_output

    plain, streamed, structured = asyncio.run(run())
    assert len(cities) == 2 and plain == f"sunny, 21 C in {cities[0]}"
    assert streamed == f"sunny, 21 C in {cities[1]}"
    assert isinstance(structured, CityWeather)


def test_pydantic_ai_responses_model(idle_server: ServerProcess) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=idle_server.url + "/v1", api_key="x")
    agent = Agent(
        OpenAIResponsesModel("default", provider=provider),
        output_type=CityWeather,
        model_settings={"max_tokens": 80, "temperature": 0},
    )
    assert isinstance(agent.run_sync("Paris: sunny.").output, CityWeather)

    async def streamed() -> CityWeather:
        async with agent.run_stream("Rome: rainy.") as run:
            return await run.get_output()

    assert isinstance(asyncio.run(streamed()), CityWeather)


def test_langchain_on_the_responses_api(idle_server: ServerProcess) -> None:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    llm = langchain_chat(idle_server.url, use_responses_api=True)
    call = llm.bind_tools([get_weather], tool_choice="required").invoke(QUESTION).tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    chunks = list(llm.bind_tools([get_weather], tool_choice="get_weather").stream(QUESTION))
    args = "".join(c["args"] or "" for chunk in chunks for c in chunk.tool_call_chunks)
    jsonschema.validate(json.loads(args), WEATHER["parameters"])
    assert isinstance(llm.with_structured_output(CityWeather).invoke("Paris: sunny."), CityWeather)


def test_a_schema_that_does_not_compile_is_a_400_naming_text_format(
    idle_server: ServerProcess,
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError, match="Failed to compile json_schema") as e:
        client(idle_server).responses.create(input="hi", text=fmt, **OPTIONS)
    assert e.value.param == "text.format"
