"""Optional OpenTelemetry tracing: one span per request, with child spans for its time in
the queue, its prefill and its decode, exported over OTLP/HTTP.

Off unless an endpoint is configured (--otlp-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT):
then, and only then, the opentelemetry packages are imported (`pip install
'parley[tracing]'`). Spans are made when a request finishes, from its recorded instants,
so tracing adds nothing to the token path.
"""

from __future__ import annotations

import time
from typing import Any

from app.engine.outputs import FinishedRequestStats


class RequestTracer:
    """An EngineListener that turns finished requests into spans."""

    def __init__(self, tracer_provider: Any) -> None:
        self.provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("parley")
        # Timings are time.monotonic(); spans want wall-clock nanoseconds.
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    @classmethod
    def to_endpoint(cls, endpoint: str, service_name: str = "parley") -> RequestTracer:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        return cls(provider)

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def on_tokens(self, request_id: str, num_tokens: int, gap_s: float | None) -> None:
        pass

    def on_finished(self, stats: FinishedRequestStats) -> None:
        from opentelemetry import trace

        t = stats.timings
        end = t.finished or time.monotonic()
        attributes = {
            "parley.request_id": stats.request_id,
            "parley.session_id": stats.session_id or "",
            "parley.prompt_tokens": stats.num_prompt_tokens,
            "parley.cached_tokens": stats.num_cached_tokens,
            "parley.completion_tokens": stats.num_output_tokens,
            "parley.preemptions": stats.num_preemptions,
            "parley.finish_reason": str(stats.finish_reason),
        }
        root = self.tracer.start_span(
            "llm_request", start_time=self._ns(t.arrival), attributes=attributes
        )
        context = trace.set_span_in_context(root)
        phases = [
            ("queue", t.arrival, t.first_scheduled),
            ("prefill", t.first_scheduled, t.first_token),
            ("decode", t.first_token, t.finished),
        ]
        for name, start, stop in phases:
            if start is not None and stop is not None:
                span = self.tracer.start_span(name, context=context, start_time=self._ns(start))
                span.end(end_time=self._ns(stop))
        root.end(end_time=self._ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()
