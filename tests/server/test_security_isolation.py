"""The prefix cache as a side channel, measured as the review did: one tenant (or browser)
says a PIN; another guesses it and reads `cached_tokens` on /ws and /v1. A real server on
127.0.0.1 over the real engine (its prefix cache, its KV tier) on a tiny model.

The right guess shares every block of the victim's prompt, a wrong one only the blocks
before the PIN: without isolation the right guess shows more cached tokens, and takes
less prefill (time). With isolation, nothing computed for one domain is reused for
another: every guess finds the same blocks (the guesser's own) and computes the same
number of tokens, so neither cached_tokens nor the time the prefill takes tells a right
guess from a wrong one."""

import asyncio
import json
import re
import uuid

import httpx
import pytest
import websockets

from app.config import TierConfig
from app.engine.async_engine import AsyncEngine
from app.server.app import ServerConfig, create_app
from app.server.chat_service import ChatConfig
from app.server.security import parse_keys_file
from tests.e2e.live_server import live_server
from tests.tiny import tiny_engine

SECRETS = {"/ws": ("PIN", "4821"), "/v1": ("locker code", "7305")}
WRONG = {"/ws": ["0000", "1234", "9876"], "/v1": ["5555", "2468", "1357"]}


def said(what: str, value: str) -> list[dict]:
    return [{"role": "user", "content": f"Remember this for me: my {what} is {value}, and my "
             "name is Alice Example from the fourth floor. Please keep it safe, I will ask "
             "you for it again later today."}]  # fmt: skip


async def ws_turn(url: str, messages: list[dict], headers: dict) -> int:
    """One turn on a socket of its own; its start frame's cached_tokens."""
    async with websockets.connect(url, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "chat", "id": "t", "conversation_id": uuid.uuid4().hex,
                                  "messages": messages, "params": {"max_tokens": 1}}))  # fmt: skip
        cached = None
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == "start":
                cached = frame["cached_tokens"]
            if frame["type"] in ("done", "error"):
                assert frame["type"] == "done", frame
                return cached


def v1_turn(url: str, messages: list[dict], headers: dict) -> int:
    body = {"messages": messages, "max_tokens": 1}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def prefix_hits(url: str, headers: dict | None = None) -> float:
    text = httpx.get(url + "/metrics", headers=headers).text
    return float(re.search(r"^parley:prefix_cache_hits(?:_total)? (\S+)$", text, re.M).group(1))


def guesses(server, api: str, victim: dict, guesser: dict) -> tuple[int, list[int], list[float]]:
    """The victim says its secret; the guesser warms its own cache with one wrong guess,
    then tries the others and the right one. Returns the right guess's cached tokens, the
    wrong ones', and the engine's prefix-cache hits per guess."""
    what, secret = SECRETS[api]
    ws = server.url.replace("http", "ws") + "/ws"

    def turn(messages, headers):
        if api == "/ws":
            return asyncio.run(ws_turn(ws, messages, headers))
        return v1_turn(server.url, messages, headers)

    turn(said(what, secret), victim)
    warm, *wrong = WRONG[api]
    turn(said(what, warm), guesser)
    cached, hits = {}, []
    for value in [wrong[0], secret, wrong[1]]:
        before = prefix_hits(server.url)
        cached[value] = turn(said(what, value), guesser)
        hits.append(prefix_hits(server.url) - before)
    return cached[secret], [cached[v] for v in wrong], hits


@pytest.fixture
def two_tenants(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice alice-key\nbob bob-key\n")
    return parse_keys_file(path)


ALICE = {"Authorization": "Bearer alice-key"}
BOB = {"Authorization": "Bearer bob-key"}


def serve(tokenizer, config: ServerConfig, **engine):
    return live_server(create_app(engine=AsyncEngine(tiny_engine(tokenizer, **engine)),
                                  server_config=config))  # fmt: skip


@pytest.mark.parametrize("api", ["/ws", "/v1"])
def test_without_isolation_the_prefix_cache_tells_the_pin(tokenizer, two_tenants, api):
    """The channel exists (so the test below can fail): what isolation must close."""
    config = ServerConfig(api_keys=two_tenants, chat=ChatConfig(isolate_prefix_cache=False))
    with serve(tokenizer, config) as s:
        right, wrong, hits = guesses(s, api, ALICE, BOB)
    assert right > max(wrong) and len(set(wrong)) == 1
    assert hits[1] > hits[0] == hits[2]  # the right guess did less work: it is faster


@pytest.mark.parametrize("api", ["/ws", "/v1"])
def test_several_tenants_are_isolated_by_default(tokenizer, two_tenants, api):
    config = ServerConfig(api_keys=two_tenants)  # nothing said about isolation
    assert any("isolated per tenant" in line for line in config.describe())
    with serve(tokenizer, config) as s:
        right, wrong, hits = guesses(s, api, ALICE, BOB)
        assert right == wrong[0] == wrong[1]
        assert hits[0] == hits[1] == hits[2]  # the same work for every guess
        # Each tenant still reuses its own prefixes.
        what, secret = SECRETS[api]
        again = said(what, secret)
        own = asyncio.run(ws_turn(s.url.replace("http", "ws") + "/ws", again, ALICE))
        assert own > right


def test_without_keys_each_browser_is_its_own_domain(tokenizer):
    config = ServerConfig(chat=ChatConfig(isolate_prefix_cache=True))
    with serve(tokenizer, config) as s:
        victim, guesser = (
            {"Cookie": "; ".join(f"{k}={v}" for k, v in httpx.get(s.url + "/").cookies.items())}
            for _ in range(2)
        )
        assert victim != guesser
        right, wrong, hits = guesses(s, "/ws", victim, guesser)
        assert right == wrong[0] == wrong[1] and hits[0] == hits[1] == hits[2]


def test_isolation_holds_through_the_kv_tier(tokenizer, two_tenants):
    """Blocks the pool lets go of live on in the KV tier, keyed by the same salted hashes:
    the guesser finds none of the victim's there either."""
    config = ServerConfig(api_keys=two_tenants)
    engine = tiny_engine(tokenizer, num_blocks=12, tier=TierConfig("memory"))
    try:
        with live_server(create_app(engine=AsyncEngine(engine), server_config=config)) as s:
            what, secret = SECRETS["/v1"]
            v1_turn(s.url, said(what, secret), ALICE)
            for i in range(3):  # other work pushes Alice's blocks out of the pool
                v1_turn(s.url, said("pet", f"dog number {i} " * 4), ALICE)
            r = httpx.post(s.url + "/v1/chat/completions", headers=BOB, timeout=60,
                           json={"messages": said(what, secret), "max_tokens": 1})  # fmt: skip
            details = r.json()["usage"]["prompt_tokens_details"]
            assert details["cached_tokens"] == 0 and details["tier_cached_tokens"] == 0
            r = httpx.post(s.url + "/v1/chat/completions", headers=ALICE, timeout=60,
                           json={"messages": said(what, secret), "max_tokens": 1})  # fmt: skip
            assert r.json()["usage"]["prompt_tokens_details"]["tier_cached_tokens"] > 0
    finally:
        engine.close()
