"""The page's login: refused across sites (Origin, and a token only the login page hands
out), and a cookie that dies with its key, its expiry, or a restart with a new key set.
A real server on 127.0.0.1 (fake engine) and a real login flow: the form's page first,
then its POST."""

import asyncio
import re
import ssl
from pathlib import Path

import httpx
import pytest
import trustme
import websockets

from app.server.app import ServerConfig, create_app
from app.server.security import AUTH_COOKIE, Access, parse_keys_file
from tests.e2e.live_server import live_server
from tests.server.fake_engine import FakeEngine
from tests.server.test_security import chat_once, log_in, ws_url

SECRET = b"s" * 32  # one user's servers share it (a file in their cache folder)


def keyed_server(tokenizer, keys_file: Path, live: dict | None = None, **config):
    keys = parse_keys_file(keys_file)
    server_config = ServerConfig(api_keys=keys, secret=SECRET, **config)
    app = create_app(engine=FakeEngine(tokenizer), server_config=server_config)
    return live_server(app, **(live or {}))


def keys_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    return path


@pytest.fixture
def alice_and_bob(tmp_path):
    return keys_file(tmp_path, "alice alice-key-1\nbob bob-key-1\n")


def test_a_cross_site_login_post_is_refused(tokenizer, alice_and_bob):
    with keyed_server(tokenizer, alice_and_bob) as s:
        r = httpx.post(s.url + "/login", data={"key": "alice-key-1"},
                       headers={"Origin": "http://evil.example"})  # fmt: skip
        assert r.status_code == 403 and AUTH_COOKIE not in r.headers.get("set-cookie", "")
        # Without an Origin (an older browser), the missing token gives it away.
        r = httpx.post(s.url + "/login", data={"key": "alice-key-1"})
        assert r.status_code == 403 and AUTH_COOKIE not in r.headers.get("set-cookie", "")
        # A token from another browser's page does not go with this browser's cookie.
        other = httpx.Client()
        token = re.search(r'name="csrf" value="([^"]+)"', other.get(s.url + "/").text).group(1)
        fresh = httpx.Client()
        fresh.get(s.url + "/")
        r = fresh.post(s.url + "/login", data={"key": "alice-key-1", "csrf": token})
        assert r.status_code == 403 and AUTH_COOKIE not in r.cookies
        # The page's own flow works, from its own origin too.
        ok = log_in(s.url, "alice-key-1")
        assert ok.status_code == 200 and 'id="messages"' in ok.text  # followed the 303
        wrong = log_in(s.url, "nope")
        assert wrong.status_code == 401


def test_a_cookie_dies_with_its_key_on_restart(tokenizer, tmp_path, alice_and_bob):
    jars = {}
    with keyed_server(tokenizer, alice_and_bob) as s:
        for name in ("alice", "bob"):
            client = httpx.Client(follow_redirects=True)
            assert log_in(s.url, f"{name}-key-1", client).status_code == 200
            jars[name] = {AUTH_COOKIE: client.cookies[AUTH_COOKIE]}
            assert httpx.get(s.url + "/v1/models", cookies=jars[name]).status_code == 200
    # Alice's key is rotated; Bob's is kept; the server restarts with the new set.
    rotated = keys_file(tmp_path, "alice alice-key-2\nbob bob-key-1\n")
    with keyed_server(tokenizer, rotated) as s:
        assert httpx.get(s.url + "/v1/models", cookies=jars["alice"]).status_code == 401
        assert 'action="/login"' in httpx.get(s.url + "/", cookies=jars["alice"]).text
        header = {"additional_headers": {"Cookie": f"{AUTH_COOKIE}={jars['alice'][AUTH_COOKIE]}"}}
        with pytest.raises(websockets.InvalidStatus):
            asyncio.run(chat_once(ws_url(s), **header))
        assert httpx.get(s.url + "/v1/models", cookies=jars["bob"]).status_code == 200
        assert log_in(s.url, "alice-key-2").status_code == 200
    # Bob leaves the key set altogether.
    with keyed_server(tokenizer, keys_file(tmp_path, "alice alice-key-2\n")) as s:
        assert httpx.get(s.url + "/v1/models", cookies=jars["bob"]).status_code == 401


def login_cookie(response: httpx.Response) -> str:
    """The Set-Cookie header of the login (the 303 that the client followed)."""
    headers = response.history[0].headers.get_list("set-cookie")
    return next(h for h in headers if h.startswith(AUTH_COOKIE + "="))


def test_the_cookie_has_an_age_and_is_secure_over_tls(tokenizer, alice_and_bob, tmp_path):
    with keyed_server(tokenizer, alice_and_bob, login_ttl_s=3600) as s:
        cookie = login_cookie(log_in(s.url, "alice-key-1"))
        assert "Max-Age=3600" in cookie and "HttpOnly" in cookie and "Secure" not in cookie
    authority = trustme.CA()
    authority.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        tmp_path / "server.pem"
    )
    trusted = ssl.create_default_context()
    authority.configure_trust(trusted)
    tls = {"ssl_certfile": str(tmp_path / "server.pem")}
    with keyed_server(tokenizer, alice_and_bob, live=tls) as s:
        assert s.url.startswith("https://")
        with httpx.Client(verify=trusted, follow_redirects=True) as client:
            form = client.get(s.url + "/")
            assert "Secure" in form.headers["set-cookie"]  # the form's own cookie too
            r = log_in(s.url, "alice-key-1", client)
            assert "Secure" in login_cookie(r)
            assert 'id="messages"' in r.text  # the Secure cookie went back, over TLS
    # Without keys, a browser's lineage cookie (from the page, or from /ws) is Secure too.
    app = create_app(engine=FakeEngine(tokenizer))
    with live_server(app, **tls) as s, httpx.Client(verify=trusted) as client:
        assert "Secure" in client.get(s.url + "/").headers["set-cookie"]

        async def handshake():
            url = s.url.replace("https", "wss") + "/ws"
            async with websockets.connect(url, ssl=trusted) as ws:
                return ws.response.headers["set-cookie"]

        assert "Secure" in asyncio.run(handshake())


def test_an_expired_cookie_is_refused():
    now = [1000.0]
    digest = Access.single_key("k").key_digest("default")
    access = Access({"default": digest}, secret=SECRET, login_ttl_s=60, clock=lambda: now[0])
    cookie = access.page_cookie("default")
    assert access.authenticate({}, {AUTH_COOKIE: cookie}).tenant == "default"
    now[0] += 59
    assert access.authenticate({}, {AUTH_COOKIE: cookie}) is not None
    now[0] += 2
    assert access.authenticate({}, {AUTH_COOKIE: cookie}) is None
    # A cookie of the old form (tenant and MAC, no expiry, no key) is refused.
    legacy = access._sign("tenant", "default")
    assert access.authenticate({}, {AUTH_COOKIE: legacy}) is None
