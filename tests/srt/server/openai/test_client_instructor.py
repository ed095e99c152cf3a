"""End to end: instructor (the structured-output library) on `radixlm serve` (default model),
unchanged, through its own openai clients: its default TOOLS mode (a named tool_choice holding
the pydantic schema), JSON_SCHEMA (response_format), streamed partial objects,
streamed iterables and the async client. Nested pydantic models reach the server as schemas
with ``$defs`` references. Every result is an instance of the requested model: instructor
validated the server's output against it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pydantic import BaseModel, Field

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow
instructor = pytest.importorskip("instructor")

EXTRACT = [{"role": "user", "content": "Extract: John is 30 years old."}]
NESTED = [{"role": "user", "content": "Ann is 41 and lives at 5 Main Street in Paris."}]
TWO_USERS = [{"role": "user", "content": "Extract the users: John is 30, Mary is 25."}]
OPTIONS = {"model": "default", "temperature": 0, "max_tokens": 120}


class User(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)


class Address(BaseModel):
    street: str
    city: str


class Resident(BaseModel):
    """A person and the address they live at (a nested model: ``$defs`` in its schema)."""

    name: str
    age: int
    address: Address


def patched(server: ServerProcess, mode=None, responses: list | None = None):
    """instructor over an openai client of ``server``; JSON responses land in ``responses``."""
    import openai

    hooks = {}
    if responses is not None:

        def keep(response: httpx.Response) -> None:
            response.read()
            responses.append(response.json())

        hooks = {"response": [keep]}
    raw = openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="x",
        max_retries=0,
        http_client=httpx.Client(event_hooks=hooks, timeout=300),
    )
    return instructor.from_openai(raw, mode=mode or instructor.Mode.TOOLS)


def test_tools_mode_extracts_with_one_named_call(idle_server: ServerProcess) -> None:
    responses: list[dict] = []
    user = patched(idle_server, responses=responses).chat.completions.create(
        response_model=User, messages=EXTRACT, max_retries=0, **OPTIONS
    )
    assert isinstance(user, User) and user.name == "John" and user.age == 30
    ((choice,),) = [r["choices"] for r in responses]
    assert len(choice["message"]["tool_calls"]) == 1  # named choice: one call
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_nested_models(idle_server: ServerProcess, mode: str) -> None:
    c = patched(idle_server, getattr(instructor.Mode, mode))
    resident = c.chat.completions.create(
        response_model=Resident, messages=NESTED, max_retries=0, **OPTIONS
    )
    assert isinstance(resident, Resident) and isinstance(resident.address, Address)


def test_partial_stream_ends_in_a_complete_object(idle_server: ServerProcess) -> None:
    c = patched(idle_server)
    parts = list(
        c.chat.completions.create_partial(response_model=Resident, messages=NESTED, **OPTIONS)
    )
    assert len(parts) > 1  # streamed: the object grows
    Resident.model_validate(parts[-1].model_dump())


def test_iterable_stream_yields_models(idle_server: ServerProcess) -> None:
    c = patched(idle_server)
    users = list(
        c.chat.completions.create_iterable(response_model=User, messages=TWO_USERS, **OPTIONS)
    )
    assert users and all(isinstance(u, User) for u in users)


def test_async_client(idle_server: ServerProcess) -> None:
    import openai

    raw = openai.AsyncOpenAI(base_url=idle_server.url + "/v1", api_key="x", max_retries=0)
    c = instructor.from_openai(raw)

    async def run() -> User:
        return await c.chat.completions.create(
            response_model=User, messages=EXTRACT, max_retries=0, **OPTIONS
        )

    user = asyncio.run(run())
    assert isinstance(user, User) and user.name == "John"
