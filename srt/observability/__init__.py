"""Operating the server: OpenTelemetry traces of requests (``tracing.py``, the SDK behind it in
``otel.py``, imported only when tracing is on) and the request dump (``request_dump.py``)."""
