"""Responses a client alone could size past reason (n x max_tokens x top_logprobs), and
/metrics behind a key of its own. A real server on 127.0.0.1 (fake engine)."""

import httpx
import pytest

from app.server.app import ServerConfig, create_app
from app.server.openai_request import MAX_RESPONSE_ENTRIES
from tests.e2e.live_server import live_server
from tests.server.fake_engine import FakeEngine

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tokenizer):
    fake = FakeEngine(tokenizer)  # a context of 2048 tokens
    with live_server(create_app(engine=fake)) as s:
        s.fake = fake
        yield s


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_a_response_too_large_to_build_is_refused_with_a_clear_400(server):
    before = len(server.fake.prompts)
    body = {"messages": MESSAGES, "n": 64, "max_tokens": 2000, "logprobs": True,
            "top_logprobs": 20}  # fmt: skip
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "response_too_large" and error["param"] == "n"
    assert "2688000" in error["message"] and "stream" in error["message"]
    # Without max_tokens the reply may run to the context: that is what counts.
    body = {"messages": MESSAGES, "n": 16, "logprobs": True, "top_logprobs": 20}
    assert post(server, "/v1/chat/completions", body).status_code == 400
    body = {"prompt": "hi", "n": 128, "max_tokens": 2000, "logprobs": 5}
    assert post(server, "/v1/completions", body).json()["error"]["code"] == "response_too_large"
    assert len(server.fake.prompts) == before  # refused before the engine heard of it


def test_within_the_cap_or_streamed_is_served(server):
    body = {"messages": MESSAGES, "n": 64, "max_tokens": 2000}  # no logprobs: 128000 entries
    assert MAX_RESPONSE_ENTRIES >= 64 * 2000
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 64
    body = {"messages": MESSAGES, "n": 4, "max_tokens": 20, "logprobs": True, "top_logprobs": 20}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    # Streamed, nothing is held: the client reads it as it comes.
    body = {"messages": MESSAGES, "n": 64, "max_tokens": 2000, "logprobs": True,
            "top_logprobs": 20, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert any(line == "data: [DONE]" for line in r.iter_lines())


def test_metrics_can_want_a_key_of_their_own(tokenizer):
    config = ServerConfig(api_key="tenant-key", metrics_key="scraper-key")
    with live_server(create_app(engine=FakeEngine(tokenizer), server_config=config)) as s:
        url = s.url + "/metrics"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        # A tenant's key does not open it: the figures are every tenant's.
        assert httpx.get(url, headers={"Authorization": "Bearer tenant-key"}).status_code == 401
        r = httpx.get(url, headers={"Authorization": "Bearer scraper-key"})
        assert r.status_code == 200 and "parley:num_requests_running" in r.text
        assert httpx.get(s.url + "/health").status_code == 200  # probes stay open
    # By default (scrapers on loopback) it stays open, keys or not.
    config = ServerConfig(api_key="tenant-key")
    with live_server(create_app(engine=FakeEngine(tokenizer), server_config=config)) as s:
        assert httpx.get(s.url + "/metrics").status_code == 200
