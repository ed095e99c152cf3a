"""Request traces across the three processes' hooks, with the SDK's in-memory exporter: one
trace per request, parented by the caller's traceparent; nothing at all when tracing is off."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from radixlm.srt.messages import BatchTokenOut
from radixlm.srt.observability.http_call import CURRENT_CALL, CallRecord, observe_prepared
from radixlm.srt.observability.tracing import (
    DetokenizerTraces,
    NullTracer,
    SchedulerTraces,
    TraceSettings,
    make_tracer,
    traces_url,
)

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
ON = TraceSettings(enabled=True)


def _out(rid: str, finished: bool) -> BatchTokenOut:
    return BatchTokenOut(
        rids=[rid],
        new_token_ids=[[7]],
        finish_reason=[{"type": "length", "length": 2} if finished else None],
        prompt_tokens=[3],
        completion_tokens=[2 if finished else 1],
        cached_tokens=[0],
        no_stop_trim=[False],
        skip_special_tokens=[True],
        output_token_logprobs=[None],
        output_top_logprobs=[None],
        input_token_logprobs=[None],
        input_top_logprobs=[None],
    )


def _one_request(http_tracer, sched_tracer, detok_tracer, headers, external=None):
    """One request through the hooks of the HTTP process, the scheduler and the detokenizer."""
    call = CallRecord("/generate", "POST", headers, http_tracer, ON)
    inp = SimpleNamespace(external_trace_header=external, text="hi there")
    msg = SimpleNamespace(input_ids=[1, 2, 3], trace_context=None)
    prepared = SimpleNamespace(inp=inp, msg=msg, observer=None, rid="r1", client_rid="c1")
    token = CURRENT_CALL.set(call)
    try:
        observe_prepared([prepared], 0)
    finally:
        CURRENT_CALL.reset(token)
    sched = SchedulerTraces(sched_tracer)
    req = SimpleNamespace(
        rid="r1", prompt_ids=[1, 2, 3], output_ids=[], cached_tokens=0, finish_reason=None
    )
    sched.on_arrival(req, msg.trace_context)
    batch = SimpleNamespace(reqs=[req], starts=[0], extend_lens=[3])
    sched.on_forward(batch, 0.0)  # the prefill chunk
    req.output_ids.append(7)
    first = _out("r1", False)
    sched.on_output([req], first)
    batch.starts[0] = 3
    sched.on_forward(batch, 0.0)  # a decode forward
    req.output_ids.append(7)
    req.finish_reason = {"type": "length", "length": 2}
    last = _out("r1", True)
    sched.on_output([req], last)
    detok = DetokenizerTraces(detok_tracer)
    detok.on_batch(first)
    detok.on_batch(last)
    call.status = 200
    call.close(None)
    return msg, first, last


def test_one_trace_across_the_three_processes_under_the_callers_parent():
    exporters = [InMemorySpanExporter() for _ in range(3)]
    procs = ("http", "sched", "detok")
    tracers = [make_tracer(ON, p, e) for p, e in zip(procs, exporters, strict=True)]
    msg, first, last = _one_request(*tracers, {"traceparent": TRACEPARENT})
    spans = {p: e.get_finished_spans() for p, e in zip(procs, exporters, strict=True)}
    names = {p: sorted(s.name for s in ss) for p, ss in spans.items()}
    assert names == {
        "http": ["request", "tokenize"],
        "sched": ["decode", "prefill", "queue", "scheduler"],
        "detok": ["detokenize"],
    }
    every = [s for ss in spans.values() for s in ss]
    assert {format(s.context.trace_id, "032x") for s in every} == {TRACE_ID}
    root = next(s for s in spans["http"] if s.name == "request")
    assert format(root.parent.span_id, "016x") == PARENT_ID
    assert all(s.parent.span_id == root.context.span_id for s in every if s is not root)
    sched = next(s for s in spans["sched"] if s.name == "scheduler")
    assert sched.attributes["radixlm.completion_tokens"] == 2
    assert sched.attributes["radixlm.finish_reason"] == "length"
    assert sched.attributes["radixlm.tokens_per_decode_forward"] == 1.0
    assert "radixlm.prompt_text" not in root.attributes  # no text unless asked
    assert msg.trace_context["traceparent"].split("-")[1] == TRACE_ID
    assert first.trace_contexts == [] and last.trace_contexts == [msg.trace_context]


def test_external_trace_header_parents_the_trace_without_a_header():
    exporters = [InMemorySpanExporter() for _ in range(3)]
    tracers = [make_tracer(ON, "p", e) for e in exporters]
    _one_request(*tracers, {}, external={"traceparent": TRACEPARENT})
    root = next(s for s in exporters[0].get_finished_spans() if s.name == "request")
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID


def test_prompt_text_only_when_asked():
    exporter = InMemorySpanExporter()
    settings = TraceSettings(enabled=True, include_prompt_text=True)
    call = CallRecord("/generate", "POST", {}, make_tracer(settings, "http", exporter), settings)
    inp = SimpleNamespace(external_trace_header=None, text="hi there")
    msg = SimpleNamespace(input_ids=[1])
    call.on_prepared([SimpleNamespace(inp=inp, msg=msg, rid="r", client_rid="r")], 0)
    call.close(None)
    root = next(s for s in exporter.get_finished_spans() if s.name == "request")
    assert list(root.attributes["radixlm.prompt_text"]) == ["hi there"]
    assert root.parent is None  # no parent given: a new trace


def test_tracing_off_records_nothing():
    null = NullTracer()
    msg, first, last = _one_request(null, null, null, {"traceparent": TRACEPARENT})
    assert msg.trace_context is None
    assert first.trace_contexts == [] and last.trace_contexts == []
    sched = SchedulerTraces(null)
    sched.on_arrival(SimpleNamespace(rid="x"), {"traceparent": TRACEPARENT})
    assert sched.live == {}


def test_tracing_off_imports_no_opentelemetry():
    code = (
        "import sys\n"
        "from radixlm.srt.config import ServerConfig\n"
        "from radixlm.srt.observability.tracing import TraceSettings, make_tracer\n"
        "import radixlm.srt.server.http.observe, radixlm.srt.managers.detokenizer_process\n"
        "make_tracer(TraceSettings.from_config(ServerConfig()), 'x')\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "given, url",
    [
        (None, None),
        ("localhost:4318", "http://localhost:4318/v1/traces"),
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("https://c.example/otlp/v1/traces", "https://c.example/otlp/v1/traces"),
    ],
)
def test_traces_url(given, url):
    assert traces_url(given) == url
