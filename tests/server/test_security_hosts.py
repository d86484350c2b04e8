"""DNS rebinding and cross-origin requests, against a real server on 127.0.0.1.

A page on evil.example whose name the attacker rebinds to 127.0.0.1 sends `Host:
evil.example:PORT` and, being same-origin with itself, `Origin: http://evil.example:PORT`.
The WebSocket client here connects to 127.0.0.1 while naming evil.example in its URL, as
the browser would; httpx forges the headers the same way."""

import asyncio
import json

import httpx
import pytest
import websockets
from hypothesis import given, settings
from hypothesis import strategies as st

from app.server.app import ServerConfig, create_app
from app.server.hosts import HostPolicy, check, split_host
from tests.e2e.live_server import live_server
from tests.server.fake_engine import FakeEngine
from tests.server.test_security import chat_once, ws_url

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(tokenizer):
    fake = FakeEngine(tokenizer)
    with live_server(create_app(engine=fake)) as s:
        s.fake = fake
        yield s


def rebound(server, path="/ws"):
    """A URL on the attacker's name, and where it really connects."""
    return f"ws://evil.example:{server.port}{path}", {"host": "127.0.0.1", "port": server.port}


def test_a_rebound_name_cannot_open_the_websocket(server):
    url, to = rebound(server)
    for origin in (f"http://evil.example:{server.port}", None):  # a page; a script
        with pytest.raises(websockets.InvalidStatus) as err:
            asyncio.run(chat_once(url, origin=origin, **to))
        assert err.value.response.status_code == 403
    # The same connection under a loopback name is served.
    for name in ("127.0.0.1", "localhost"):
        ok = f"ws://{name}:{server.port}/ws"
        assert (
            asyncio.run(chat_once(ok, origin=f"http://{name}:{server.port}", **to))["type"]
            == "done"
        )


@pytest.mark.parametrize("path", ["/", "/health", "/metrics", "/v1/models", "/static/app.js"])
def test_every_route_refuses_a_foreign_host(server, path):
    forged = {"Host": f"evil.example:{server.port}"}
    r = httpx.get(server.url + path, headers=forged)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "host_not_allowed"
    assert "--allowed-hosts" in r.json()["error"]["message"]
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "localhost", "[::1]:80"):
        assert httpx.get(server.url + path, headers={"Host": host}).status_code == 200, host


def test_a_rebound_name_cannot_chat_over_v1(server):
    before = len(server.fake.prompts)
    forged = {"Host": f"evil.example:{server.port}", "Origin": f"http://evil.example:{server.port}",
              "Content-Type": "text/plain"}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(CHAT), headers=forged)
    assert r.status_code == 400
    assert len(server.fake.prompts) == before  # the engine never heard of it


def test_a_cross_origin_simple_post_is_refused(server):
    """text/plain needs no preflight: a page elsewhere could send it and never read the
    answer, but the turn would run with the visitor's cookies."""
    before = len(server.fake.prompts)
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{server.port + 1}"):
        headers = {"Origin": origin, "Content-Type": "text/plain"}
        r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(CHAT),
                       headers=headers)  # fmt: skip
        assert r.status_code == 403, origin
        assert r.json()["error"]["code"] == "cross_origin"
    # A browser that sends no Origin still tells where the request comes from.
    headers = {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"}
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
    assert r.status_code == 403
    assert len(server.fake.prompts) == before
    # The page's own origin, and clients that are not browsers (no Origin), are served.
    own = {"Origin": server.url, "Sec-Fetch-Site": "same-origin"}
    assert (
        httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=own).status_code == 200
    )
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_allowed_hosts_add_names_and_star_opts_out(tokenizer):
    config = ServerConfig(allowed_hosts=("chat.example.org", ".corp.example"))
    with live_server(create_app(engine=FakeEngine(tokenizer), server_config=config)) as s:

        def status(host):
            return httpx.get(s.url + "/health", headers={"Host": host}).status_code

        assert status("chat.example.org") == 200
        assert status("a.corp.example:8443") == 200 and status("corp.example") == 200
        assert status(f"localhost:{s.port}") == 200  # the loopback names stay
        assert status("evil.example") == 400 and status("xcorp.example") == 400
        url = f"ws://chat.example.org:{s.port}/ws"
        frame = asyncio.run(chat_once(url, origin=f"http://chat.example.org:{s.port}",
                                      host="127.0.0.1", port=s.port))  # fmt: skip
        assert frame["type"] == "done"
    config = ServerConfig(allowed_hosts=("*",))
    with live_server(create_app(engine=FakeEngine(tokenizer), server_config=config)) as s:
        assert httpx.get(s.url + "/health", headers={"Host": "evil.example"}).status_code == 200


def test_bound_to_every_address_any_ip_literal_is_a_host(tokenizer):
    """0.0.0.0: the server is reached by its addresses. A Host that is an IP literal cannot
    be a rebound name (the page that sent it was loaded from that very address)."""
    config = ServerConfig(host="0.0.0.0")
    with live_server(create_app(engine=FakeEngine(tokenizer), server_config=config)) as s:

        def status(host):
            return httpx.get(s.url + "/health", headers={"Host": host}).status_code

        assert status("192.168.1.20:8000") == 200 and status("[fe80::1]:8000") == 200
        assert status("evil.example") == 400
    config = ServerConfig(host="192.168.1.20")  # one address: that one and loopback
    with live_server(create_app(engine=FakeEngine(tokenizer), server_config=config)) as s:
        assert httpx.get(s.url + "/health", headers={"Host": "192.168.1.20"}).status_code == 200
        assert httpx.get(s.url + "/health", headers={"Host": "10.0.0.1"}).status_code == 400


def test_the_page_itself_still_works(server):
    """Same origin all the way: the page, its assets, its socket."""
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and 'id="messages"' in page.text
    origin = {"origin": server.url}
    assert asyncio.run(chat_once(ws_url(server), **origin))["type"] == "done"


@given(host=st.text(max_size=40), origin=st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_any_host_or_origin_header_gets_an_answer_not_an_exception(host, origin):
    """Whatever bytes a client puts in Host and Origin, the guard decides; and it lets
    through only hosts it would name itself."""
    policy = HostPolicy.build("127.0.0.1")
    headers = [(b"host", host.encode("latin-1", "replace")),
               (b"origin", origin.encode("latin-1", "replace"))]  # fmt: skip
    refusal = check(policy, {"type": "http", "scheme": "http", "method": "POST",
                             "headers": headers})  # fmt: skip
    if refusal is None:
        assert split_host(host.encode("latin-1", "replace").decode("latin-1"))[0] in (
            "localhost", "127.0.0.1", "::1")  # fmt: skip
