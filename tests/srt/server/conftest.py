"""Fixtures of the server tests that drive `radixlm serve` on the default model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tool_util import assert_server_idle


@pytest.fixture(scope="module")
def default_server(start_server):
    """`radixlm serve` on the default model, one per test module."""
    return start_server("--max-total-tokens", 8192)


@pytest.fixture
def idle_server(default_server) -> Iterator:
    """The module's default-model server; after the test it must be healthy, idle and leak no
    KV (``tool_util.assert_server_idle``)."""
    yield default_server
    assert_server_idle(default_server.url)
