"""Request traces: one OpenTelemetry trace per request across the three server processes.

The HTTP process opens the request's root span (its parent: a W3C ``traceparent`` header, else
the body's ``external_trace_header``) and a ``tokenize`` span; the root span's context travels
to the scheduler in ``TokenizedGenerateReq.trace_context`` and on to the detokenizer in
``BatchTokenOut.trace_contexts`` (a W3C carrier: ``{"traceparent": ..., "tracestate": ...}``).
The scheduler adds ``queue``, one ``prefill`` span per chunk, ``decode`` and the request's
``scheduler`` span (token counts, cached tokens, finish reason, tokens per decode forward);
the detokenizer adds ``detokenize``. No prompt or output text unless ``--trace-prompt-text``.

Off (the default) everything here is a null object: no span, no opentelemetry import, a no-op
method call at each hook. ``make_tracer`` imports the SDK (``otel.py``) only when tracing is on.
The scheduler hooks read requests and batches by duck typing (``rid``, ``prompt_ids``,
``output_ids``, ``cached_tokens``, ``finish_reason``; ``reqs``, ``starts``, ``extend_lens``):
this module sits below the scheduler and imports nothing of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

Carrier = dict[str, str]  # W3C trace context: traceparent (and tracestate)
ATTR = "radixlm."  # prefix of this project's span attributes


@dataclass(frozen=True)
class TraceSettings:
    enabled: bool = False
    endpoint: str | None = None  # OTLP/HTTP traces URL; None: the OTEL_* variables decide
    include_prompt_text: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> TraceSettings:
        return cls(
            enabled=cfg.enable_trace,
            endpoint=traces_url(cfg.otlp_traces_endpoint),
            include_prompt_text=cfg.trace_prompt_text,
        )


def traces_url(endpoint: str | None) -> str | None:
    """An OTLP/HTTP traces URL from a flag's value: ``host:port`` (SGLang's form) gets
    ``http://`` and ``/v1/traces``; a URL without a path gets ``/v1/traces``."""
    if not endpoint:
        return None
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        url = f"{scheme}://{rest}/v1/traces"
    return url


class Span(Protocol):
    def set(self, attributes: dict[str, Any]) -> None: ...
    def end(self, end_ns: int | None = None) -> None: ...
    def carrier(self) -> Carrier: ...


class Tracer(Protocol):
    enabled: bool

    def start(
        self,
        name: str,
        parent: Carrier | Span | None,
        start_ns: int | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> Span: ...

    def record(
        self,
        name: str,
        parent: Carrier | Span | None,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any] | None = None,
    ) -> None: ...

    def flush(self) -> None: ...


class NullSpan:
    def set(self, attributes: dict[str, Any]) -> None:
        pass

    def end(self, end_ns: int | None = None) -> None:
        pass

    def carrier(self) -> Carrier:
        return {}


NULL_SPAN = NullSpan()


class NullTracer:
    """Tracing off: no spans, nothing imported."""

    enabled = False

    def start(self, name, parent, start_ns=None, attributes=None) -> Span:  # noqa: ANN001
        return NULL_SPAN

    def record(self, name, parent, start_ns, end_ns, attributes=None) -> None:  # noqa: ANN001
        pass

    def flush(self) -> None:
        pass


def make_tracer(settings: TraceSettings, process: str, exporter: Any = None) -> Tracer:
    """The process's tracer: the null one when tracing is off; else the SDK's, exporting over
    OTLP/HTTP (``exporter``: another SpanExporter, for tests). Raises ValueError naming the
    extra to install when the SDK is missing."""
    if not settings.enabled:
        return NullTracer()
    try:
        from radixlm.srt.observability.otel import OtelTracer
    except ImportError as e:
        raise ValueError(
            "--enable-trace needs the OpenTelemetry SDK: pip install 'radixlm[trace]' "
            f"(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http): {e}"
        ) from None
    return OtelTracer(process, settings.endpoint, exporter)


def now_ns() -> int:
    return time.time_ns()


# ---------------------------------------------------------------------- scheduler side
@dataclass
class _SchedulerTrace:
    carrier: Carrier
    arrival_ns: int
    first_chunk_ns: int | None = None
    prefill_end_ns: int | None = None
    num_chunks: int = 0
    num_decode_forwards: int = 0


class SchedulerTraces:
    """The scheduler's spans of the requests that arrive with a trace context (the others,
    and every request while tracing is off, cost one dict lookup per hook at most)."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.live: dict[str, _SchedulerTrace] = {}

    def on_arrival(self, req: Any, carrier: Carrier | None) -> None:
        if carrier and self.tracer.enabled:
            self.live[req.rid] = _SchedulerTrace(carrier, now_ns())

    def on_forward(self, batch: Any, started_s: float) -> None:
        """One forward of ``batch`` ran from ``started_s`` (``time.perf_counter()``) to now: a
        prefill chunk of the rows still in their prompt, a decode forward of the others."""
        if not self.live:
            return
        end_ns = now_ns()
        start_ns = end_ns - int((time.perf_counter() - started_s) * 1e9)
        for i, req in enumerate(batch.reqs):
            t = self.live.get(req.rid)
            if t is None:
                continue
            start = batch.starts[i]
            if start >= len(req.prompt_ids):
                t.num_decode_forwards += 1
                continue
            if t.first_chunk_ns is None:
                t.first_chunk_ns = start_ns
                self.tracer.record("queue", t.carrier, t.arrival_ns, start_ns)
            t.num_chunks += 1
            t.prefill_end_ns = end_ns
            self.tracer.record(
                "prefill",
                t.carrier,
                start_ns,
                end_ns,
                {
                    ATTR + "chunk_index": t.num_chunks - 1,
                    ATTR + "chunk_start": start,
                    ATTR + "extend_tokens": batch.extend_lens[i],
                    ATTR + "batch_size": len(batch.reqs),
                },
            )

    def on_output(self, touched: list[Any], out: Any) -> None:
        """After a step: the finished traced requests get their ``decode`` and ``scheduler``
        spans, and the step's output carries their contexts to the detokenizer."""
        if not self.live:
            return
        end = now_ns()
        for req in touched:
            if req.finish_reason is None or req.rid not in self.live:
                continue
            t = self.live.pop(req.rid)
            attrs = request_attributes(req, t)
            if t.prefill_end_ns is not None and req.output_ids:
                self.tracer.record("decode", t.carrier, t.prefill_end_ns, end, attrs)
            self.tracer.record("scheduler", t.carrier, t.arrival_ns, end, attrs)
            if out is not None and req.rid in out.rids:
                if not out.trace_contexts:
                    out.trace_contexts = [None] * len(out.rids)
                out.trace_contexts[out.rids.index(req.rid)] = t.carrier


def request_attributes(req: Any, t: _SchedulerTrace) -> dict[str, Any]:
    reason = req.finish_reason or {}
    attrs: dict[str, Any] = {
        ATTR + "rid": req.rid,
        ATTR + "prompt_tokens": len(req.prompt_ids),
        ATTR + "completion_tokens": len(req.output_ids),
        ATTR + "cached_tokens": req.cached_tokens,
        ATTR + "prefill_chunks": t.num_chunks,
        ATTR + "finish_reason": str(reason.get("type", "")),
    }
    if t.num_decode_forwards:  # > 1 token per forward: speculative drafts were accepted
        attrs[ATTR + "decode_forwards"] = t.num_decode_forwards
        attrs[ATTR + "tokens_per_decode_forward"] = (len(req.output_ids) - 1) / (
            t.num_decode_forwards
        )
    return attrs


# ---------------------------------------------------------------------- detokenizer side
@dataclass
class DetokenizerTraces:
    """The detokenizer's span of each traced request: from its first output to its last."""

    tracer: Tracer
    first_seen_ns: dict[str, int] = field(default_factory=dict)

    def on_batch(self, out: Any) -> None:
        if not self.tracer.enabled:
            return
        now = now_ns()
        for rid in out.rids:
            self.first_seen_ns.setdefault(rid, now)
        for i, carrier in enumerate(out.trace_contexts):
            if carrier:
                rid = out.rids[i]
                self.tracer.record(
                    "detokenize",
                    carrier,
                    self.first_seen_ns.get(rid, now),
                    now_ns(),
                    {ATTR + "completion_tokens": out.completion_tokens[i]},
                )
        for i, reason in enumerate(out.finish_reason):
            if reason is not None:
                self.first_seen_ns.pop(out.rids[i], None)
