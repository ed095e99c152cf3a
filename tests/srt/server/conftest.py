"""Fixtures of the server tests: the session's shared `radixlm serve` on the default model
(``default_server`` of tests/conftest.py) checked idle after each test (``idle_server``), and the HTTP process over fake_stack's scripted worker with the hermes tool
parser (``stack``, its strict openai client ``client``, and ``idle_stack`` for
``pytest.mark.usefixtures``). A module changes the fake stack's options by defining
``stack_options``, or defines its own ``stack``."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from fake_stack import FakeStack
from tool_util import assert_idle, assert_server_idle, strict_client


@pytest.fixture
def idle_server(default_server) -> Iterator:
    """The shared default-model server; after the test it must be healthy, idle and leak no
    KV (``tool_util.assert_server_idle``)."""
    yield default_server
    assert_server_idle(default_server.url)


@pytest.fixture(scope="module")
def stack_options() -> dict:
    return {"tool_call_parser": "hermes"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, stack_options) -> Iterator:
    s = FakeStack(tmp_path_factory.mktemp("ipc"), **stack_options)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(stack: FakeStack) -> openai.OpenAI:
    return strict_client(stack.url)


@pytest.fixture
def idle_stack(stack: FakeStack) -> Iterator:
    """After the test the fake stack is healthy and holds no request any more."""
    yield stack
    assert_idle(stack)
