"""The chat page re-attaches its reply after the network drops mid-reply (headless
Chromium, the real model, greedy): the reply completes with no gap and no duplicate, and
equals an uninterrupted one."""

import json

import pytest

from app.config import CacheConfig, EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.e2e.test_chat_page import send
from tests.server.fake_engine import FakeEngine


@pytest.fixture
def server(smollm):
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(64 << 20)), smollm))
    with live_server(create_app(engine=engine)) as s:
        yield s


def stored_messages(page):
    """The messages shown of the current conversation, as the page stored them."""
    saved = json.loads(page.evaluate("localStorage.getItem('parley.v2')"))
    current = next(c for c in saved["conversations"] if c["id"] == saved["currentId"])
    nodes, out = current["nodes"], []
    node = nodes["root"]
    while node["children"]:
        node = nodes[node["children"][node["active"]]]
        out.append(node)
    return out


def wait_done(page, count):
    page.wait_for_function(
        "n => document.querySelectorAll('.message.assistant:not(.streaming)').length >= n"
        " && !document.querySelector('.message.streaming')",
        arg=count,
        timeout=60_000,
    )


def test_the_page_resumes_its_reply_after_going_offline(browser, server):
    context = browser.new_context()
    page = context.new_page()
    frames: list[dict] = []  # what the page received, on every socket
    sent: list[dict] = []
    sockets = []

    def watch(ws):
        sockets.append(ws)
        n = len(sockets)
        ws.on("framereceived", lambda payload: frames.append({**json.loads(payload), "on": n}))
        ws.on("framesent", lambda payload: sent.append(json.loads(payload)))

    page.on("websocket", watch)
    page.goto(server.url)
    page.wait_for_selector("#connection[data-state=open]")
    page.click("#toggle-settings")
    page.fill("#setting-temperature", "0")
    page.fill("#setting-max-tokens", "100")
    for field in ("#setting-temperature", "#setting-max-tokens"):
        page.dispatch_event(field, "change")
    page.click("#settings-save-defaults")  # settings are per chat: the second one's too

    send(page, "Tell me a long story.")
    page.wait_for_function(
        "() => document.querySelector('.message.assistant .bubble').innerText.length > 30"
    )
    context.set_offline(True)  # the page lets its socket go; the server keeps the turn
    page.wait_for_selector("#connection[data-state=reconnecting]")
    page.wait_for_timeout(800)
    context.set_offline(False)
    page.wait_for_selector("#connection[data-state=open]", timeout=20_000)
    wait_done(page, 1)

    assert len(sockets) >= 2  # it did reconnect, re-attach, and get the rest there
    (resume,) = [f for f in sent if f["type"] == "resume"]
    assert resume["after_seq"] >= 0
    assert any(f["type"] == "token" and f["on"] > 1 for f in frames)
    resumed = [f for f in frames if f.get("type") == "token"]
    seqs = sorted({f["seq"] for f in resumed})
    assert seqs == list(range(len(seqs)))  # every seq arrived on one socket or the other
    done = [f for f in frames if f.get("type") == "done"]
    assert len(done) == 1 and done[0]["finish_reason"] in ("stop", "length")
    reply = stored_messages(page)[1]
    assert not reply.get("error") and not reply.get("partial")
    by_seq = {f["seq"]: f["text"] for f in resumed}
    assert reply["content"] == "".join(by_seq[s] for s in seqs)  # no gap, no duplicate

    # The same question in a new conversation, never interrupted: the same reply.
    page.click("#new-chat")
    send(page, "Tell me a long story.")
    wait_done(page, 1)
    assert stored_messages(page)[1]["content"] == reply["content"]
    context.close()


def test_a_reply_the_server_lost_is_marked_interrupted(browser, tokenizer):
    """A restart without a journal: the page's resume finds nothing, and says so."""
    fake = FakeEngine(tokenizer, delay=0.02, reply=" ".join(f"w{i}" for i in range(500)))
    with live_server(create_app(engine=fake)) as first:
        port = first.port
        context = browser.new_context()
        page = context.new_page()
        page.goto(first.url)
        page.wait_for_selector("#connection[data-state=open]")
        send(page, "Talk for a while")
        page.wait_for_function(
            "() => document.querySelector('.message.assistant .bubble').innerText.length > 10"
        )
    page.wait_for_selector("#connection[data-state=reconnecting]")
    with live_server(create_app(engine=FakeEngine(tokenizer)), port=port):
        page.wait_for_selector("#connection[data-state=open]", timeout=20_000)
        page.wait_for_selector(".message.assistant:not(.streaming)")
        assert "interrupted" in page.locator(".message.assistant .meta").inner_text()
        assert page.locator(".message.assistant .bubble").inner_text().startswith("w0")
    context.close()
