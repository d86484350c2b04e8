"""What the page tests share: a live server over the fake engine, and waiting for replies."""

from contextlib import contextmanager

from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.server.fake_engine import FakeEngine

DESKTOP = {"width": 1100, "height": 800}
PHONE = {"width": 375, "height": 700}


@contextmanager
def fake_server(tokenizer, reply="A short reply.", delay=0.002):
    fake = FakeEngine(tokenizer, delay=delay, reply=reply)
    with live_server(create_app(engine=fake)) as server:
        server.fake = fake
        yield server


def open_page(browser, server, viewport=DESKTOP, mobile=False, **kw):
    context = browser.new_context(viewport=viewport, is_mobile=mobile, has_touch=mobile, **kw)
    page = context.new_page()
    page.on("dialog", lambda d: d.accept())
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    page.goto(server.url)
    page.wait_for_selector("#connection[data-state=open]")
    return page


def send(page, text):
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_reply_done(page, count=1, timeout=30_000):
    """Until `count` replies are shown, none streams, and each shows rendered Markdown."""
    page.wait_for_function(
        "n => document.querySelectorAll('.message.assistant').length >= n"
        " && !document.querySelector('.message.streaming')"
        " && !document.querySelector('.message.assistant .bubble:not(.rendered)')",
        arg=count,
        timeout=timeout,
    )


def set_setting(page, selector, value):
    if not page.is_visible("#settings"):
        page.click("#toggle-settings")
    page.fill(selector, str(value))
    page.dispatch_event(selector, "change")
