"""The real model behind the real page, with a 256-token window: a conversation runs far
past it without an error, the thread says which messages the model no longer sees, the
gauge shows the window's use, and a reply cut at its length limit is continued."""

import json

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.e2e.page_util import DESKTOP, send, set_setting, wait_reply_done

WINDOW = 256
QUESTIONS = [
    "Name a large city in France.",
    "What river runs through it?",
    "Name a famous museum there.",
    "What is a well known dish of that country?",
    "Which mountains lie on its border with Spain?",
    "Name a French painter.",
    "What is the capital of Italy?",
    "And of Spain?",
]


def test_a_conversation_past_the_window_and_a_continued_reply(smollm, browser):
    config = EngineConfig(model=ModelConfig(max_model_len=WINDOW), cache=CacheConfig(64 << 20))
    engine = AsyncEngine(LLMEngine(config, smollm))
    with live_server(create_app(engine=engine)) as server:
        context = browser.new_context(viewport=DESKTOP)
        page = context.new_page()
        sent = []
        page.on("websocket", lambda ws: ws.on("framesent", lambda f: sent.append(json.loads(f))))
        page.goto(server.url)
        page.wait_for_selector("#connection[data-state=open]")
        set_setting(page, "#setting-temperature", 0)
        set_setting(page, "#setting-max-tokens", 40)
        page.click("#toggle-settings")
        used = []
        for i, question in enumerate(QUESTIONS):
            send(page, question)
            wait_reply_done(page, i + 1, timeout=120_000)
            assert not page.locator(".message .error").count(), page.locator(".error").inner_text()
            label = page.locator("#gauge .label").inner_text()
            used.append(int(label.split(" / ")[0].replace(",", "")))
            assert label.endswith(f" / {WINDOW}")
        assert max(used) <= WINDOW and len(set(used)) > 1
        # The thread says where what the model sees begins, before a user message.
        note = page.locator(".dropped")
        assert note.count() == 1
        assert "no longer seen by the model" in note.inner_text()
        assert note.evaluate("n => n.nextElementSibling.classList.contains('user')")
        assert page.locator(".message.user").count() == len(QUESTIONS)  # all still shown
        # The page sent the whole history each turn: the server did the dropping.
        chats = [f for f in sent if f.get("type") == "chat"]
        assert len(chats[-1]["messages"]) == 2 * len(QUESTIONS) - 1

        # A reply cut at its length limit goes on with "Continue".
        page.click("#new-chat")
        # A new chat starts from the default settings: greedy again, so that the reply is
        # the same every run (a sampled "4." renders as an empty list item).
        set_setting(page, "#setting-temperature", 0)
        set_setting(page, "#setting-max-tokens", 10)
        page.click("#toggle-settings")
        send(page, "Count from one to twenty in words, separated by commas.")
        wait_reply_done(page, timeout=120_000)
        assert "length limit" in page.locator(".message.assistant .stats").inner_text()
        before = page.locator(".message.assistant .bubble").inner_text()
        page.click(".message.assistant .continue")
        wait_reply_done(page, timeout=120_000)
        after = page.locator(".message.assistant .bubble").inner_text()
        assert page.locator(".message.assistant").count() == 1  # the same reply, longer
        assert after.startswith(before.rstrip()) and len(after) > len(before)
        assert chats[-1] is not sent[-1]
        last = [f for f in sent if f.get("type") == "chat"][-1]
        assert last["continue"] is True and last["messages"][-1]["role"] == "assistant"
        assert not page.locator(".message .error").count()
        context.close()
