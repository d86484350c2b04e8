"""OpenTelemetry: one span per request with queue / prefill / decode children; off by
default."""

import sys

import pytest
from starlette.testclient import TestClient

from app.config import CacheConfig, EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.server.app import create_app
from app.server.tracing import RequestTracer
from tests.server.testclient import for_testclient

sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)


def test_a_request_becomes_a_span_tree(smollm):
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(64 << 20)), smollm))
    app = create_app(
        engine=engine, server_config=for_testclient(), listeners=[RequestTracer(provider)]
    )
    with TestClient(app) as client:
        r = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
        )
        assert r.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
    root = spans["llm_request"]
    assert root.attributes["parley.completion_tokens"] == r.json()["usage"]["completion_tokens"]
    for name in ("queue", "prefill", "decode"):
        child = spans[name]
        assert child.parent.span_id == root.context.span_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    assert spans["queue"].end_time <= spans["prefill"].start_time
    assert spans["prefill"].end_time <= spans["decode"].start_time


def test_tracing_is_off_and_not_imported_by_default(tokenizer):
    from tests.server.fake_engine import FakeEngine

    with TestClient(
        create_app(engine=FakeEngine(tokenizer), server_config=for_testclient())
    ) as client:
        assert client.get("/health").status_code == 200
    # Only this test module imported the SDK; the app itself did not need the exporter.
    assert "opentelemetry.exporter.otlp.proto.http.trace_exporter" not in sys.modules


def test_spans_reach_an_otlp_endpoint(smollm):
    import http.server
    import threading

    received = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    collector = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        from app.server.app import ServerConfig

        endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
        engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(64 << 20)), smollm))
        app = create_app(
            engine=engine, server_config=for_testclient(ServerConfig(otlp_endpoint=endpoint))
        )
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200
        # Shutting the app down flushed the batch exporter.
        assert received and received[0][0] == "/v1/traces"
        assert received[0][1] == "application/x-protobuf" and b"llm_request" in received[0][2]
    finally:
        collector.shutdown()
