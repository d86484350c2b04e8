"""Who may connect: API key on /v1 and /ws, the page's key form, the Origin check, the
connection limit. A live server on 127.0.0.1 (fake engine) and real clients."""

import asyncio
import json
import re
import uuid

import httpx
import pytest
import websockets

from app.server.app import ServerConfig, create_app
from app.server.chat_service import ChatConfig
from tests.e2e.live_server import live_server
from tests.server.fake_engine import FakeEngine

KEY = "s3cret-key"


def ws_url(server):
    return server.url.replace("http", "ws") + "/ws"


async def chat_once(url, **connect):
    async with websockets.connect(url, **connect) as ws:
        conversation = uuid.uuid4().hex  # each socket here is a client of its own
        await ws.send(json.dumps({"type": "chat", "id": "t", "conversation_id": conversation,
                                  "messages": [{"role": "user", "content": "hi"}]}))  # fmt: skip
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] in ("done", "error"):
                return frame


def log_in(url: str, key: str, client: httpx.Client | None = None) -> httpx.Response:
    """What a browser does: load the page (the form and its token), then post the form."""
    if client is None:
        with httpx.Client(follow_redirects=True) as client:
            return log_in(url, key, client)
    page = client.get(url + "/")
    token = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert token, "the login form carries a token"
    return client.post(url + "/login", data={"key": key, "csrf": token.group(1)})


@pytest.fixture
def keyed(tokenizer):
    app = create_app(engine=FakeEngine(tokenizer), server_config=ServerConfig(api_key=KEY))
    with live_server(app) as s:
        yield s


def test_v1_needs_the_bearer_key(keyed):
    url = keyed.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    r = httpx.get(url, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200


def test_ws_needs_the_key_and_the_page_hands_out_a_cookie(keyed):
    with pytest.raises(websockets.InvalidStatus) as err:
        asyncio.run(chat_once(ws_url(keyed)))
    assert err.value.response.status_code == 403
    bearer = {"additional_headers": {"Authorization": f"Bearer {KEY}"}}
    assert asyncio.run(chat_once(ws_url(keyed), **bearer))["type"] == "done"

    page = httpx.get(keyed.url + "/")
    assert page.status_code == 200 and 'action="/login"' in page.text
    assert log_in(keyed.url, "nope").status_code == 401
    ok = log_in(keyed.url, KEY, httpx.Client())  # not following the redirect
    assert ok.status_code == 303
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and KEY not in cookie
    jar = {"parley_auth": ok.cookies["parley_auth"]}
    assert 'id="messages"' in httpx.get(keyed.url + "/", cookies=jar).text
    header = {"additional_headers": {"Cookie": f"parley_auth={jar['parley_auth']}"}}
    assert asyncio.run(chat_once(ws_url(keyed), **header))["type"] == "done"


def test_foreign_origins_are_refused(tokenizer):
    config = ServerConfig(allowed_origins=("https://chat.example.org",))
    with live_server(create_app(engine=FakeEngine(tokenizer), server_config=config)) as s:
        own = {"origin": s.url}
        assert asyncio.run(chat_once(ws_url(s), **own))["type"] == "done"
        assert asyncio.run(chat_once(ws_url(s)))["type"] == "done"  # no Origin: not a browser
        allowed = {"origin": "https://chat.example.org"}
        assert asyncio.run(chat_once(ws_url(s), **allowed))["type"] == "done"
        with pytest.raises(websockets.InvalidStatus) as err:
            asyncio.run(chat_once(ws_url(s), origin="http://evil.example.com"))
        assert err.value.response.status_code == 403


def test_more_sockets_than_allowed_are_told_busy(tokenizer):
    config = ServerConfig(chat=ChatConfig(max_connections=3))
    with live_server(create_app(engine=FakeEngine(tokenizer), server_config=config)) as s:

        async def main():
            held = [await websockets.connect(ws_url(s)) for _ in range(3)]
            async with websockets.connect(ws_url(s)) as extra:
                frame = json.loads(await extra.recv())
                assert frame["code"] == "busy" and frame["retryable"]
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await extra.recv()
                assert closed.value.rcvd.code == 1013
            await held[0].close()
            await asyncio.sleep(0.1)
            assert (await chat_once(ws_url(s)))["type"] == "done"  # room again
            for ws in held[1:]:
                await ws.close()

        asyncio.run(main())
