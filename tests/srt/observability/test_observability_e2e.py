"""A real server with tracing and the request dump on: one request's spans from the three
processes reach a local OTLP/HTTP receiver under one trace, parented by the caller's
traceparent; the recorded calls replay against a fresh server with equal greedy outputs."""

from __future__ import annotations

import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import plain_http
import pytest

from radixlm.srt.bench.replay import compare, load_dump, replay, report

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

pytestmark = pytest.mark.slow

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
GREEDY = {"temperature": 0, "max_new_tokens": 12}


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP traces endpoint: keeps (process, span) of every export."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        req = ExportTraceServiceRequest()
        req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        for rs in req.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                with self.server.lock:
                    self.server.spans += [(attrs.get("radixlm.process"), s) for s in ss.spans]
        body = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def receiver():
    server = Receiver()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def traced(start_server, receiver, tmp_path_factory):
    """The module's own server (its trace endpoint and dump folder are the module's)."""
    dump_dir = tmp_path_factory.mktemp("dump")
    old = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the children export within 0.1 s
    try:
        server = start_server(
            "--max-total-tokens", 8192, "--enable-trace", "--dump-requests-dir", dump_dir,
            "--otlp-traces-endpoint", f"127.0.0.1:{receiver.server_address[1]}",
        )  # fmt: skip
    finally:
        if old is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY")
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = old
    return server, dump_dir


def test_one_trace_across_the_three_processes(traced, receiver):
    server, _ = traced
    r = plain_http.post(
        server.url + "/generate",
        json={"text": "The capital of France is", "sampling_params": GREEDY},
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        timeout=60,
    )
    assert r.status_code == 200
    wanted = {"request", "tokenize", "queue", "prefill", "decode", "scheduler", "detokenize"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with receiver.lock:
            mine = [(p, s) for p, s in receiver.spans if s.trace_id.hex() == TRACE_ID]
        if wanted <= {s.name for _, s in mine}:
            break
        time.sleep(0.2)
    assert wanted <= {s.name for _, s in mine}, sorted(s.name for _, s in mine)
    assert {p for p, _ in mine} == {"http", "scheduler", "detokenizer"}
    (root,) = [s for _, s in mine if s.name == "request"]
    assert root.parent_span_id.hex() == PARENT_ID
    assert all(s.parent_span_id == root.span_id for _, s in mine if s is not root)
    (sched,) = [s for _, s in mine if s.name == "scheduler"]
    attrs = {a.key: a.value for a in sched.attributes}
    assert attrs["radixlm.completion_tokens"].int_value == 12
    assert attrs["radixlm.finish_reason"].string_value == "length"


def test_a_dumped_run_replays_with_equal_greedy_outputs(traced, default_server):
    server, dump_dir = traced
    calls = [
        ("/generate", {"text": "Once upon a time", "sampling_params": GREEDY}),
        ("/generate", {"text": ["1, 2, 3,", "Red, green,"], "sampling_params": GREEDY}),
        ("/generate", {"text": "def add(a, b):", "sampling_params": GREEDY, "stream": True}),
        ("/v1/completions", {"prompt": "Paris is", "max_tokens": 10, "temperature": 0}),
        ("/v1/chat/completions", {"max_tokens": 10, "temperature": 0,
                                  "messages": [{"role": "user", "content": "Say hi"}]}),
    ]  # fmt: skip
    before = len(load_dump(dump_dir)) if list(dump_dir.iterdir()) else 0
    with httpx.Client(timeout=60, headers={"Authorization": "Bearer s3cret"}) as client:
        for route, body in calls:
            assert client.post(server.url + route, json=body).status_code == 200
    deadline = time.monotonic() + 10
    while len(load_dump(dump_dir)) < before + len(calls) and time.monotonic() < deadline:
        time.sleep(0.1)
    records = load_dump(dump_dir)[before:]
    assert [r["route"] for r in records] == [route for route, _ in calls]
    assert b"s3cret" not in b"".join(p.read_bytes() for p in dump_dir.iterdir())
    assert records[1]["sequences"][1]["completion_tokens"] == 12
    results = __import__("asyncio").run(replay(records, default_server.url, rate_scale=4.0))
    comparison = compare(results)
    out = io.StringIO()
    report(comparison, out)
    print(out.getvalue())
    assert comparison.num_sequences == 6
    assert comparison.all_equal, out.getvalue()
    assert "latency_s" in out.getvalue()
