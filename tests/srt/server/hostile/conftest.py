"""Hostile clients against a real `radixlm serve` on 127.0.0.1 (the modules of this folder).

What is checked is what a user of SGLang or vLLM expects: a 4xx in the OpenAI error shape (never a
5xx, never a hang: every client call has a timeout), and after every test the shared check of
``hostile_util.assert_clean``: /health is 200, no request state is left and the idle KV pool adds
up. Two servers over a tiny random Llama with SmolLM2's tokenizer (fast start), shared by the
folder's modules: the main one (context 512, KV pool 2048) and one with ``--api-key`` and a
256-token pool (and ``--admin-api-key``: two callers with keys of their own).
"""

from __future__ import annotations

import pytest
from hostile_util import (
    ADMIN_KEY,
    API_KEY,
    CONTEXT,
    POOL,
    SMALL_POOL,
    LiveServer,
    assert_clean,
    start_all,
)


@pytest.fixture(scope="package")
def servers(tiny_llama_dir, tmp_path_factory):
    common = ["--model-path", str(tiny_llama_dir), "--grammar-compile-timeout-s", "10"]
    main = LiveServer(
        [*common, "--context-length", str(CONTEXT), "--max-total-tokens", str(POOL)],
        tmp_path_factory.mktemp("main"),
    )
    keyed = LiveServer(
        [*common, "--max-total-tokens", str(SMALL_POOL), "--admin-api-key", ADMIN_KEY],
        tmp_path_factory.mktemp("keyed"),
        api_key=API_KEY,
    )
    start_all([main, keyed])
    yield main, keyed
    main.stop()
    keyed.stop()


@pytest.fixture(scope="package")
def server(servers) -> LiveServer:
    return servers[0]


@pytest.fixture(scope="package")
def keyed(servers) -> LiveServer:
    return servers[1]


@pytest.fixture(autouse=True)
def leak_check(servers):
    """Every test starts on healthy servers and ends with the shared check on both."""
    for s in servers:
        s.ensure_running()
    yield
    for s in servers:
        assert_clean(s)
