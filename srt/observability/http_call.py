"""One HTTP generate call while tracing or the request dump is on (``CallRecord``).

The server's middleware (``server/http/observe.py``) makes the record when a call arrives and
sets it as the current call (a context variable); the tokenizer manager finds it there when it
tokenizes (``on_prepared``: the root span, the ``tokenize`` span, the trace context sent to the
scheduler) and tells it each request's updates (``on_update``); the middleware closes it when
the response has been sent (``close``: the root span ends, the dump line is written).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import orjson

from radixlm.srt.observability.request_dump import RequestDump, redact, redact_headers
from radixlm.srt.observability.tracing import ATTR, NULL_SPAN, Span, Tracer, TraceSettings

CURRENT_CALL: ContextVar[CallRecord | None] = ContextVar("radixlm_current_call", default=None)


@dataclass
class CallRecord:
    route: str
    method: str
    headers: dict[str, str]  # lowercase names
    tracer: Tracer
    settings: TraceSettings
    dump: RequestDump | None = None
    arrival_time: float = field(default_factory=time.time)
    arrival_ns: int = field(default_factory=time.time_ns)
    arrival_s: float = field(default_factory=time.perf_counter)
    status: int | None = None
    root: Span = NULL_SPAN
    sequences: dict[str, dict[str, Any]] = field(default_factory=dict)  # internal rid -> figures

    def _root(self, external_header: dict[str, Any] | None) -> Span:
        if self.root is NULL_SPAN and self.tracer.enabled:
            parent = (
                {k: self.headers[k] for k in ("traceparent", "tracestate") if k in self.headers}
                or {str(k): str(v) for k, v in (external_header or {}).items()}
                or None
            )
            self.root = self.tracer.start(
                "request",
                parent,
                self.arrival_ns,
                {"http.route": self.route, "http.request.method": self.method},
            )
        return self.root

    def on_prepared(self, prepared: list[Any], tokenize_start_ns: int) -> None:
        """The call's requests are tokenized and checked (``PreparedReq`` objects)."""
        if not prepared:
            return
        root = self._root(prepared[0].inp.external_trace_header)
        if self.tracer.enabled:
            num_prompt = sum(len(p.msg.input_ids) for p in prepared)
            self.tracer.record(
                "tokenize",
                root,
                tokenize_start_ns,
                time.time_ns(),
                {ATTR + "num_sequences": len(prepared), ATTR + "prompt_tokens": num_prompt},
            )
            if self.settings.include_prompt_text:
                texts = [p.inp.text for p in prepared if p.inp.text is not None]
                root.set({ATTR + "prompt_text": texts})
            carrier = root.carrier()
        for p in prepared:
            p.observer = self
            self.sequences.setdefault(p.rid, {"rid": p.client_rid, "ttft_s": None})
            if self.tracer.enabled:
                p.msg.trace_context = carrier

    def on_update(self, state: Any, num_new: int, now: float) -> None:
        """An update of one request (a ``ReqState``; ``now``: ``time.perf_counter()``)."""
        seq = self.sequences.setdefault(state.rid, {"rid": state.req.client_rid, "ttft_s": None})
        if num_new and seq["ttft_s"] is None and state.finish_reason is None:
            seq["ttft_s"] = now - self.arrival_s
        if state.finish_reason is not None:
            r = state.result
            seq.update(
                output_ids=list(r.output_ids),
                text=r.text,
                finish_reason=r.finish_reason,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens,
                cached_tokens=r.cached_tokens,
                e2e_s=now - self.arrival_s,
            )

    def close(self, body: bytes | None) -> None:
        """The response has been sent (or the call ended without one)."""
        latency_s = time.perf_counter() - self.arrival_s
        seqs = list(self.sequences.values())
        if self.root is not NULL_SPAN:
            self.root.set(
                {
                    "http.response.status_code": self.status or 0,
                    ATTR + "num_sequences": len(seqs),
                    ATTR + "completion_tokens": sum(s.get("completion_tokens", 0) for s in seqs),
                    ATTR + "cached_tokens": sum(s.get("cached_tokens", 0) for s in seqs),
                }
            )
            self.root.end()
        if self.dump is not None and body is not None:
            self.dump.write(
                {
                    "route": self.route,
                    "method": self.method,
                    "arrival_time": self.arrival_time,
                    "headers": redact_headers(self.headers),
                    "body": redact(_json_or_text(body)),
                    "status": self.status,
                    "latency_s": latency_s,
                    "sequences": seqs,
                }
            )


def _json_or_text(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return {"_unparsed_body": body.decode("utf-8", "replace")}


def observe_prepared(prepared: list[Any], tokenize_start_ns: int) -> None:
    """Hands the call's prepared requests to the current call record, when there is one."""
    call = CURRENT_CALL.get()
    if call is not None:
        call.on_prepared(prepared, tokenize_start_ns)
