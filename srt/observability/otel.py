"""The OpenTelemetry SDK behind ``tracing.Tracer`` (imported only when tracing is on).

Each process has its own ``TracerProvider`` (not the global one: a library embedding radixlm
keeps its own), a batch span processor and the OTLP/HTTP exporter. The standard variables
apply: ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (resource), ``OTEL_TRACES_SAMPLER``
(sampler), ``OTEL_EXPORTER_OTLP_TRACES_*`` / ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers,
timeout), ``OTEL_BSP_*`` (batching) and ``OTEL_SDK_DISABLED``.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from radixlm.srt.observability.tracing import Carrier

_PROPAGATOR = TraceContextTextMapPropagator()


class OtelSpan:
    def __init__(self, span: Any) -> None:
        self.span = span

    def set(self, attributes: dict[str, Any]) -> None:
        self.span.set_attributes(attributes)

    def end(self, end_ns: int | None = None) -> None:
        self.span.end(end_time=end_ns)

    def carrier(self) -> Carrier:
        carrier: Carrier = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier


class OtelTracer:
    enabled = True

    def __init__(self, process: str, endpoint: str | None, exporter: Any = None) -> None:
        attrs = {"radixlm.process": process}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attrs["service.name"] = "radixlm"
        self.provider = TracerProvider(resource=Resource.create(attrs))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint)))
        else:  # tests: spans reach their exporter as they end
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("radixlm")
        atexit.register(self.provider.shutdown)  # the batch left is sent on a clean exit

    def _context(self, parent: Carrier | OtelSpan | None) -> Any:
        if isinstance(parent, OtelSpan):
            return trace.set_span_in_context(parent.span)
        return _PROPAGATOR.extract(parent) if parent else None

    def start(self, name, parent, start_ns=None, attributes=None) -> OtelSpan:  # noqa: ANN001
        kind = trace.SpanKind.SERVER if name == "request" else trace.SpanKind.INTERNAL
        span = self.tracer.start_span(
            name, self._context(parent), kind=kind, attributes=attributes, start_time=start_ns
        )
        return OtelSpan(span)

    def record(self, name, parent, start_ns, end_ns, attributes=None) -> None:  # noqa: ANN001
        span = self.tracer.start_span(
            name, self._context(parent), attributes=attributes, start_time=start_ns
        )
        span.end(end_time=end_ns)

    def flush(self) -> None:
        self.provider.force_flush()
