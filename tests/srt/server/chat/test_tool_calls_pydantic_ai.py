"""End to end: pydantic-ai agents drive tool calling on `radixlm serve` (default model) through
its OpenAI chat-completions model. Structured output the pydantic-ai way (a ``final_result``
output tool under ``tool_choice: "required"``, blocking and streamed) validates as the output
type; a tool loop really calls the Python tool with a string and then ends with an output. Every
request body is recorded, so the tests also pin what pydantic-ai sends."""

from __future__ import annotations

import json

import plain_http
import pytest
from pydantic import BaseModel, Field

from radixlm.srt.server.process.server_process import ServerProcess

pytest.importorskip("pydantic_ai", reason="pydantic-ai (pydantic-ai-slim[openai]) is not installed")
httpx2 = pytest.importorskip("httpx2", reason="pydantic-ai's HTTP client (httpx2) is not installed")

from pydantic_ai import Agent, RunContext  # noqa: E402
from pydantic_ai.models import create_async_httpx2_client  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402
from pydantic_ai.settings import ModelSettings  # noqa: E402
from pydantic_ai.usage import UsageLimits  # noqa: E402

pytestmark = pytest.mark.slow

QUESTION = "What is the weather in Paris?"
# Greedy, short and without SDK retries: a failed request fails the test at once.
SETTINGS = ModelSettings(temperature=0, max_tokens=64, max_retries=0, timeout=120)
# A loop that never ends fails fast instead of running to pydantic-ai's own limit.
LIMITS = UsageLimits(request_limit=4)


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Weather(BaseModel):
    """The weather in one city."""

    city: str = Field(max_length=40)
    summary: str = Field(max_length=80)


class RecordingTransport(httpx2.AsyncHTTPTransport):
    """Keeps the JSON body of every chat-completions request pydantic-ai sends."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict] = []

    async def handle_async_request(self, request):
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))
        return await super().handle_async_request(request)


@pytest.fixture(scope="module")
def server(default_server) -> ServerProcess:
    return default_server


@pytest.fixture(autouse=True)
def _healthy(server: ServerProcess):
    yield
    assert plain_http.get(server.url + "/health", timeout=30).status_code == 200


@pytest.fixture
def transport() -> RecordingTransport:
    return RecordingTransport()


@pytest.fixture
def model(server: ServerProcess, transport: RecordingTransport) -> OpenAIChatModel:
    served = plain_http.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    provider = OpenAIProvider(
        base_url=server.url + "/v1",
        api_key="x",
        http_client=create_async_httpx2_client(transport=transport),
    )
    return OpenAIChatModel(served or "default", provider=provider)


def make_agent(model: OpenAIChatModel, **kwargs) -> Agent:
    agent = Agent(model, **kwargs)
    agent.instrument = False  # no spans, whatever Agent.instrument_all says
    return agent


def function_names(body: dict) -> list[str]:
    return [tool["function"]["name"] for tool in body.get("tools", [])]


# ---------------------------------------------------------------------- structured output
def test_structured_output_by_output_tool(model, transport) -> None:
    agent = make_agent(model, output_type=City, model_settings=SETTINGS)
    result = agent.run_sync("Name the capital of France and its country.", usage_limits=LIMITS)
    assert isinstance(result.output, City) and result.output.name and result.output.country
    (body,) = transport.bodies  # the first reply validated: no retry request
    assert function_names(body) == ["final_result"]
    assert body["tool_choice"] == "required"
    assert body["temperature"] == 0 and body["max_completion_tokens"] == 64


def test_structured_output_streamed(model, transport) -> None:
    agent = make_agent(model, output_type=City, model_settings=SETTINGS)
    with agent.run_stream_sync(
        "Name the capital of Italy and its country.", usage_limits=LIMITS
    ) as stream:
        partials = list(stream.stream_output())
        output = stream.get_output()
    assert isinstance(output, City) and output.name and output.country
    assert partials and all(isinstance(p, City) for p in partials)
    (body,) = transport.bodies
    assert body["stream"] is True and body["tool_choice"] == "required"


# ---------------------------------------------------------------------- tool loop
def make_weather_agent(model, calls: list[str], **kwargs) -> Agent:
    agent = make_agent(
        model,
        instructions="Answer weather questions. Call get_weather, then answer.",
        **kwargs,
    )

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"sunny, 21 C in {city}"

    return agent


def weather_first(calls: list[str], then: object):
    """Model settings per step: get_weather is forced until it has run, then ``then``."""

    def settings(ctx: RunContext) -> ModelSettings:
        return ModelSettings(**SETTINGS, tool_choice=then if calls else ["get_weather"])

    return settings


FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def assert_weather_called(calls: list[str], bodies: list[dict], first_choice: object) -> None:
    """One get_weather call with a city, then one request carrying its call and result."""
    (city,) = calls
    assert isinstance(city, str) and city.strip(), calls
    assert len(bodies) == 2 and bodies[0]["tool_choice"] == first_choice
    later = bodies[1]["messages"]
    (call_turn,) = [m for m in later if m["role"] == "assistant" and m.get("tool_calls")]
    (call,) = call_turn["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": city}
    (result,) = [m for m in later if m["role"] == "tool"]
    assert result["tool_call_id"] == call["id"] and city in result["content"]


def test_tool_loop_ends_with_output_tool(model, transport) -> None:
    calls: list[str] = []
    # "none" keeps the output tool: pydantic-ai then names final_result as the only choice.
    agent = make_weather_agent(
        model, calls, output_type=Weather, model_settings=weather_first(calls, "none")
    )
    result = agent.run_sync(QUESTION, usage_limits=LIMITS)
    assert isinstance(result.output, Weather) and result.output.city
    assert_weather_called(calls, transport.bodies, FORCE_WEATHER)
    last = transport.bodies[-1]
    assert function_names(last) == ["get_weather", "final_result"]
    assert last["tool_choice"] == {"type": "function", "function": {"name": "final_result"}}


def test_tool_loop_ends_with_text(model, transport) -> None:
    calls: list[str] = []
    agent = make_weather_agent(model, calls, model_settings=weather_first(calls, "none"))
    result = agent.run_sync(QUESTION, usage_limits=LIMITS)
    answer = result.output
    assert isinstance(answer, str) and answer.strip() and "tool_calls" not in answer, answer
    # get_weather is the only tool sent, so forcing it by name goes out as "required".
    assert_weather_called(calls, transport.bodies, "required")
    assert transport.bodies[-1]["tool_choice"] == "none"


# ---------------------------------------------------------------------- Anthropic's API
def test_structured_output_over_anthropic_messages(server: ServerProcess) -> None:
    """pydantic-ai's AnthropicModel on /v1/messages: the output tool comes back as a tool_use
    block whose input validates as the output type (its default max_tokens, far past this
    model's context, reads as "up to the context")."""
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    served = plain_http.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    model = AnthropicModel(served, provider=AnthropicProvider(base_url=server.url, api_key="x"))
    settings = ModelSettings(temperature=0, max_retries=0)  # greedy: one reply, no retry
    agent = make_agent(model, output_type=City, model_settings=settings)
    result = agent.run_sync("Name the capital of France and its country.", usage_limits=LIMITS)
    assert isinstance(result.output, City) and result.output.name and result.output.country
