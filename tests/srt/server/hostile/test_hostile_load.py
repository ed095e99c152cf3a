"""Hostile clients that used to stall the event loop or multiply memory (see conftest.py): huge
tool lists in every dialect, the parse routes' long texts, score's pre-count, long rids in
batches, Vertex parameters and session turns, get_weights_by_name's truncate_size. Each case
measures the longest /health wait meanwhile (``load_util.HealthProbe``) and, for the memory
cases, the HTTP process's RSS growth per request; every test ends with the folder's leak check.
Run with ``-s`` to read the figures."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
from hostile_util import LiveServer, assert_4xx, assert_openai_error, gen
from load_util import HealthProbe, check_rss_growth, rss_bytes

from radixlm.srt.server.http.body import MAX_RID_CHARS, MAX_TOOLS

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "hi"}]


def _function_tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"t{i}"}} for i in range(n)]


def _bodies(n: int) -> dict[str, tuple[str, dict]]:
    """A body of every dialect that takes tools, with ``n`` of them."""
    anthropic = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(n)]
    flat = [
        {"type": "function", "name": f"t{i}", "parameters": {"type": "object"}} for i in range(n)
    ]
    return {
        "chat": ("/v1/chat/completions", {"messages": USER, "tools": _function_tools(n)}),
        "responses": ("/v1/responses", {"model": "default", "input": "hi", "tools": flat}),
        "messages": (
            "/v1/messages",
            {"model": "default", "max_tokens": 2, "messages": USER, "tools": anthropic},
        ),
        "count_tokens": (
            "/v1/messages/count_tokens",
            {"model": "default", "messages": USER, "tools": anthropic},
        ),
        "parse": (
            "/parse_function_call",
            {"text": "hi", "tools": _function_tools(n), "tool_call_parser": "hermes"},
        ),
    }


@pytest.mark.parametrize("num_tools", [MAX_TOOLS + 1, 32_768, 100_000])
def test_huge_tool_lists_are_refused_before_any_tool_is_read(
    server: LiveServer, num_tools: int
) -> None:
    """32k tools on count_tokens stalled /health 36 s (a quadratic name check on the loop)."""
    bodies = _bodies(num_tools)
    before = rss_bytes(server)
    for dialect, (path, body) in bodies.items():
        raw = orjson.dumps(body)
        with HealthProbe(server) as probe:
            r = server.post(path, raw=raw, timeout=60)
        assert_openai_error(r, (400,))
        assert r.json()["error"]["param"] == "tools", r.text[:300]
        assert f"at most {MAX_TOOLS}" in r.json()["error"]["message"], r.text[:300]
        probe.check(f"{dialect} with {num_tools} tools ({len(raw) / 2**20:.1f} MiB)")
    check_rss_growth(f"{num_tools} tools", before, rss_bytes(server), len(bodies))


def test_the_most_tools_pass_the_tool_check_everywhere(server: LiveServer) -> None:
    """128 tools are read (on this 512-token context their prompt is then too long: a 400
    naming the messages or the prompt, never the tools; /parse_function_call answers)."""
    for dialect, (path, body) in _bodies(MAX_TOOLS).items():
        with HealthProbe(server) as probe:
            r = server.post(path, body, timeout=60)
        if dialect == "parse":
            assert r.status_code == 200, r.text[:300]
        else:
            assert_openai_error(r, (400,))
            assert r.json()["error"]["param"] != "tools", (dialect, r.text[:300])
        probe.check(f"{dialect} with {MAX_TOOLS} tools (read)")


def test_parse_routes_are_capped_and_linear(server: LiveServer) -> None:
    """2 MiB of repeated <tool_call> stalled /health 10.5 s (8 MiB: 229 s)."""
    huge = "<tool_call>x" * (2 * 2**20 // 12)
    for path, extra in [
        ("/parse_function_call", {"tool_call_parser": "hermes", "tools": _function_tools(1)}),
        ("/separate_reasoning", {"reasoning_parser": "qwen3"}),
    ]:
        with HealthProbe(server) as probe:
            r = server.post(path, {"text": huge, **extra}, timeout=60)
        err = assert_openai_error(r, (400,))
        assert err["param"] == "text" and "at most" in err["message"], err
        probe.check(f"{path} with {len(huge)} characters (refused)")
        limit = int(err["message"].rsplit(" ", 1)[1])
        longest = ("<tool_call>x" * (limit // 12 + 1))[:limit]
        with HealthProbe(server) as probe:
            r = server.post(path, {"text": longest, **extra}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        probe.check(f"{path} with {len(longest)} characters (the longest accepted)")


def test_score_is_pre_counted_before_every_prompt_is_tokenized(server: LiveServer) -> None:
    """Four 25 KB /v1/score bodies took 9-10 s each of tokenizing before the token cap."""
    body = {"query": "word " * 4_000, "items": ["a"] * 1024, "label_token_ids": [1, 2]}
    with HealthProbe(server) as probe, ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda _: server.post("/v1/score", body, timeout=60), range(4)))
    for r in rs:
        err = assert_openai_error(r, (400,))
        assert err["param"] == "items", err
    probe.check("4 concurrent /v1/score with a 20 KB query x 1024 items")
    # elapsed is the whole answer: the pre-count refuses before any item is tokenized
    assert max(r.elapsed.total_seconds() for r in rs) < 3.0, [r.elapsed for r in rs]


def test_long_rids_are_refused_before_they_are_multiplied(server: LiveServer) -> None:
    """1,024 prompts with a 256 KiB rid grew the HTTP process by 726 MiB."""
    rid = "r" * 262_144
    batch = {"text": ["hi"] * 1024, "rid": rid, "sampling_params": {"max_new_tokens": 1}}
    vertex = {"instances": [{"text": "hi"}] * 64, "parameters": {"rid": rid}}
    session = {"text": "hi", "session_params": {"id": "s", "rid": rid}}
    cases = [
        ("/generate", batch),
        ("/generate", {"text": "hi", "rid": rid, "sampling_params": {"n": 4}}),
        ("/vertex_generate", vertex),
        ("/generate", session),
        ("/v1/chat/completions", {"messages": USER, "rid": rid, "n": 8}),
        ("/v1/completions", {"prompt": ["a"] * 64, "rid": rid}),
        ("/abort_request", {"rid": rid}),
        ("/open_session", {"capacity_of_str_len": 64, "session_id": rid}),
    ]
    gen(server)  # warm: the first request's allocations are not the hostile ones
    before = rss_bytes(server)
    with HealthProbe(server) as probe:
        for _ in range(4):
            for path, body in cases:
                err = assert_4xx(server.post(path, body, timeout=60))
                assert "rid" in str(err["param"]) or "session_id" in str(err["param"]), err
    check_rss_growth(
        "long rids (batch, n, Vertex, session, chat, abort)",
        before,
        rss_bytes(server),
        4 * len(cases),
    )
    probe.check("long rids")
    ok = "r" * MAX_RID_CHARS
    r = server.post("/generate", {**batch, "text": ["hi"] * 8, "rid": ok})
    assert r.status_code == 200 and r.json()[3]["meta_info"]["id"] == f"{ok}_3", r.text[:300]


def test_get_weights_by_name_truncate_size_is_a_400(server: LiveServer) -> None:
    name = "model.embed_tokens.weight"
    for size in ("1" + "0" * 30, "0", "-1", str(2**20 + 1)):
        r = server.get(f"/get_weights_by_name?name={name}&truncate_size={size}")
        err = assert_openai_error(r, (400,))
        assert err["param"] == "truncate_size", err
    r = server.post("/get_weights_by_name", {"name": name, "truncate_size": 1e30})
    assert_openai_error(r, (400,))
    r = server.post("/get_weights_by_name", {"name": name, "truncate_size": 2})
    assert r.status_code == 200 and len(r.json()) == 2, r.text[:300]
