"""The chat page in a real browser (headless Chromium) against a live server."""

import re

import pytest

from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.server.fake_engine import FakeEngine

REPLY = (
    "Here is **bold** and `code`.\n\n```python\nprint('hi')\n```\n\n<img src=x onerror=alert(1)>"
)


@pytest.fixture
def fake(tokenizer):
    return FakeEngine(tokenizer, delay=0.005, reply=REPLY)


@pytest.fixture
def server(fake):
    with live_server(create_app(engine=fake)) as s:
        yield s


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    p = context.new_page()
    p.on("dialog", lambda d: d.accept())
    p.goto(server.url)
    p.wait_for_selector("#connection[data-state=open]")
    yield p
    context.close()


def send(page, text):
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_reply_done(page, count=1):
    """Until `count` replies are done and every reply shows its rendered Markdown."""
    page.wait_for_function(
        "n => document.querySelectorAll('.message.assistant:not(.streaming)').length >= n"
        " && !document.querySelector('.message.streaming')"
        " && !document.querySelector('.message.assistant .bubble:not(.rendered)')",
        arg=count,
    )


def test_streams_a_reply_with_safe_markdown_and_stats(page):
    send(page, "Hello there")
    wait_reply_done(page)
    bubble = page.locator(".message.assistant .bubble").last
    assert bubble.locator("strong").inner_text() == "bold"
    assert bubble.locator("pre code").inner_text().rstrip() == "print('hi')"
    assert bubble.locator("button.copy").count() == 1
    # Model text never becomes markup: the <img> arrives as text.
    assert bubble.locator("img").count() == 0
    assert "<img src=x onerror=alert(1)>" in bubble.inner_text()
    stats = page.locator(".message.assistant .stats").last.inner_text()
    assert re.search(r"reused \d+ of \d+ prompt tokens", stats)


def test_shift_enter_adds_a_line_and_enter_sends(page, fake):
    page.fill("#input", "line one")
    page.press("#input", "Shift+Enter")
    page.type("#input", "line two")
    assert page.input_value("#input") == "line one\nline two"
    assert not fake.prompts
    page.press("#input", "Enter")
    wait_reply_done(page)
    assert page.locator(".message.user .bubble").inner_text() == "line one\nline two"


def test_stop_keeps_the_partial_reply(page, fake):
    fake.reply = " ".join(f"word{i}" for i in range(400))
    fake.delay = 0.02
    send(page, "Talk for a long time")
    page.wait_for_selector(".message.streaming")
    page.wait_for_function(
        "() => document.querySelector('.message.assistant .bubble').innerText.length > 20"
    )
    page.click("#stop")
    wait_reply_done(page)
    assert "stopped" in page.locator(".message.assistant .stats").inner_text()
    text = page.locator(".message.assistant .bubble").inner_text()
    assert text.startswith("word0") and "word399" not in text


def test_a_reload_mid_reply_picks_the_reply_up_again(page, fake):
    fake.reply = " ".join(f"word{i}" for i in range(300))
    fake.delay = 0.01
    send(page, "Tell me everything")
    page.wait_for_function(
        "() => document.querySelector('.message.assistant .bubble').innerText.length > 40"
    )
    page.wait_for_timeout(700)  # the streaming reply is saved twice a second
    page.reload()
    page.wait_for_selector("#connection[data-state=open]")
    assert page.locator(".message.user .bubble").inner_text() == "Tell me everything"
    wait_reply_done(page)  # the server kept the turn: the page asked for the rest
    assert page.locator(".message.assistant .bubble").inner_text() == fake.reply
    assert "interrupted" not in page.locator(".message.assistant .meta").inner_text()
    fake.reply = "a fresh answer"
    fake.delay = 0.001
    page.click(".message.assistant .regenerate")
    wait_reply_done(page)
    assert page.locator(".message.assistant .bubble").inner_text() == "a fresh answer"


def test_regenerate_and_edit_resend_the_right_history(page, fake, tokenizer):
    send(page, "First question")
    wait_reply_done(page)
    page.click(".message.assistant .regenerate")
    wait_reply_done(page)
    assert page.locator(".message.assistant").count() == 1
    prompts = [tokenizer.decode(p) for p in fake.prompts.values()]
    assert len(prompts) == 2 and prompts[0] == prompts[1]  # same history, new reply

    page.click(".message.user .edit")
    page.fill(".message.user textarea.edit", "Edited question")
    page.click(".message.user .save")
    wait_reply_done(page)
    assert page.locator(".message.user").count() == 1
    last = tokenizer.decode(list(fake.prompts.values())[-1])
    assert "Edited question" in last and "First question" not in last


def test_conversations_survive_a_reload_and_delete_frees_the_session(page, fake):
    send(page, "Conversation one")
    wait_reply_done(page)
    page.click("#new-chat")
    send(page, "Conversation two")
    wait_reply_done(page)
    assert page.locator("#conversations li").count() == 2
    page.click("#conversations li:nth-child(1) .rename")
    page.fill("#conversations li:nth-child(1) input", "Renamed chat")
    page.press("#conversations li:nth-child(1) input", "Enter")
    page.reload()
    page.wait_for_selector("#connection[data-state=open]")
    names = page.locator("#conversations .name").all_inner_texts()
    assert names == ["Renamed chat", "Conversation one"]
    page.click("#conversations li:nth-child(2)")
    assert page.locator(".message.user .bubble").inner_text() == "Conversation one"
    conversation_ids = set(fake.sessions.values())
    page.click("#conversations li:nth-child(2) .delete")  # the dialog is accepted
    page.wait_for_function("() => document.querySelectorAll('#conversations li').length === 1")
    page.wait_for_timeout(200)
    assert len(set(fake.released) & conversation_ids) == 1


def test_settings_reach_the_server(page, fake, tokenizer):
    assert not page.is_visible("#settings")
    page.click("#toggle-settings")
    assert page.is_visible("#settings")
    page.fill("#system-prompt", "Answer like a pirate.")
    page.fill("#setting-temperature", "0.3")
    page.fill("#setting-top-p", "0.5")
    page.fill("#setting-max-tokens", "3")
    fields = ("#system-prompt", "#setting-temperature", "#setting-top-p", "#setting-max-tokens")
    for field in fields:
        page.dispatch_event(field, "change")
    send(page, "Hello")
    wait_reply_done(page)
    (params,) = fake.params.values()
    assert (params.temperature, params.top_p, params.max_tokens) == (0.3, 0.5, 3)
    assert "Answer like a pirate." in tokenizer.decode(next(iter(fake.prompts.values())))


def test_theme_toggle_persists(page):
    before = page.get_attribute("html", "data-theme")
    page.click("#toggle-theme")
    after = page.get_attribute("html", "data-theme")
    assert {before, after} == {"light", "dark"}
    page.reload()
    assert page.get_attribute("html", "data-theme") == after


def test_phone_width_layout(browser, server):
    context = browser.new_context(viewport={"width": 375, "height": 700}, is_mobile=True)
    page = context.new_page()
    page.goto(server.url)
    page.wait_for_selector("#connection[data-state=open]")
    assert page.is_visible("#toggle-sidebar") and page.is_visible("#input")
    box = page.locator("#sidebar").bounding_box()
    assert box["x"] + box["width"] <= 1  # off-canvas until opened
    page.click("#toggle-sidebar")
    page.wait_for_timeout(300)
    assert page.locator("#sidebar").bounding_box()["x"] >= 0
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 375  # nothing overflows sideways
    context.close()


def test_reconnects_after_the_server_comes_back(browser, fake):
    app = create_app(engine=fake)
    with live_server(app) as first:
        port = first.port
        context = browser.new_context()
        page = context.new_page()
        page.goto(first.url)
        page.wait_for_selector("#connection[data-state=open]")
    page.wait_for_selector("#connection[data-state=reconnecting]")
    with live_server(create_app(engine=fake), port=port):
        page.wait_for_selector("#connection[data-state=open]", timeout=20_000)
        send(page, "Back again")
        wait_reply_done(page)
    context.close()
