"""Around the thread, in a real Chromium: per-chat settings with every sampling parameter
and the server's defaults shown, export and import, search, live numbers while a reply
streams, "+ New chat" without piling up empty chats, and the phone layout (a sidebar that
closes by tapping outside, a placeholder that fits), with screenshots of both widths."""

import json
import re

import pytest

from app.server.page import sampling_defaults
from tests.e2e.page_util import (
    PHONE,
    fake_server,
    open_page,
    send,
    set_setting,
    wait_reply_done,
)


@pytest.fixture(scope="module")
def server(tokenizer):
    with fake_server(tokenizer) as s:
        yield s


VALUES = {
    "temperature": ("0.3", 0.3),
    "top-p": ("0.8", 0.8),
    "top-k": ("12", 12),
    "min-p": ("0.05", 0.05),
    "max-tokens": ("7", 7),
    "seed": ("42", 42),
    "presence-penalty": ("0.5", 0.5),
    "frequency-penalty": ("0.25", 0.25),
    "repetition-penalty": ("1.1", 1.1),
}


def test_every_sampling_parameter_per_conversation_with_defaults_shown(browser, server, tokenizer):
    fake = server.fake
    page = open_page(browser, server)
    page.click("#toggle-settings")
    defaults = sampling_defaults()
    for key, default in defaults.items():
        hint = page.locator(f"#setting-{key.replace('_', '-')}").locator("..").locator(".default")
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif default is None:
            shown = {"max_tokens": "up to the window", "seed": "random"}[key]
        elif default == []:
            shown = "none"
        else:
            shown = f"{default:g}"  # as JavaScript writes a number
        assert hint.inner_text() == f"default: {shown}", key
    for field, (text, _) in VALUES.items():
        set_setting(page, f"#setting-{field}", text)
    set_setting(page, "#setting-stop", "END\nSTOP")
    page.check("#setting-ignore-eos")
    page.dispatch_event("#setting-ignore-eos", "change")
    set_setting(page, "#system-prompt", "Answer like a pirate.")
    send(page, "Hello")
    wait_reply_done(page)
    params = list(fake.params.values())[-1]
    for field, (_, value) in VALUES.items():
        assert getattr(params, field.replace("-", "_")) == value, field
    assert params.stop == ("END", "STOP") and params.ignore_eos is True
    assert "Answer like a pirate." in tokenizer.decode(list(fake.prompts.values())[-1])

    # A new chat starts from the defaults for new chats, not from this one's settings.
    page.click("#new-chat")
    assert page.input_value("#setting-temperature") == "0.7"
    assert page.input_value("#setting-top-k") == ""
    assert page.get_attribute("#setting-top-k", "placeholder") == "0"
    send(page, "Hi again")
    wait_reply_done(page)
    params = list(fake.params.values())[-1]
    assert (params.temperature, params.top_k, params.seed, params.stop) == (0.7, 0, None, ())
    # Back to the first: its own settings.
    page.click("#conversations li:nth-child(2)")
    assert page.input_value("#setting-temperature") == "0.3"
    assert page.input_value("#system-prompt") == "Answer like a pirate."
    page.context.close()


def test_export_import_and_search(browser, server, tmp_path):
    fake = server.fake
    page = open_page(browser, server)
    fake.reply = "Lighthouses guide ships."
    send(page, "Tell me about lighthouses")
    wait_reply_done(page)
    page.click("#new-chat")
    fake.reply = "Volcanoes erupt."
    send(page, "And volcanoes")
    wait_reply_done(page)

    with page.expect_download() as download:
        page.click("#export")
    data = json.loads(download.value.path().read_text())
    nodes = [n for c in data["conversations"] for n in c["nodes"].values() if "role" in n]
    texts = [n["content"] for n in nodes]
    assert "Lighthouses guide ships." in texts and "And volcanoes" in texts

    page.fill("#search", "volcano")
    assert page.locator("#conversations .name").all_inner_texts() == ["And volcanoes"]
    page.fill("#search", "GUIDE SHIPS")  # a reply's text, any case
    assert page.locator("#conversations .name").all_inner_texts() == ["Tell me about lighthouses"]
    page.fill("#search", "nothing like it")
    assert page.locator("#conversations li.none").count() == 1
    page.fill("#search", "")

    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"title": "From elsewhere", "messages": [
        {"role": "user", "content": "imported question"},
        {"role": "assistant", "content": "imported **answer**"},
    ]}]))  # fmt: skip
    page.set_input_files("#import-file", str(other))
    page.wait_for_function("() => document.querySelector('#sidebar-note').textContent")
    assert page.locator("#sidebar-note").inner_text() == "Imported 1 conversation."
    assert page.locator("#conversations .name").first.inner_text() == "From elsewhere"
    wait_reply_done(page)
    assert page.locator(".message.assistant strong").inner_text() == "answer"
    # Our own export comes back whole (new ids where they collide).
    exported = tmp_path / "export.json"
    exported.write_text(json.dumps(data))
    page.set_input_files("#import-file", str(exported))
    page.wait_for_function(
        "() => /Imported 2/.test(document.getElementById('sidebar-note').textContent)"
    )
    assert page.locator("#conversations li").count() == 5
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    page.set_input_files("#import-file", str(bad))
    page.wait_for_function(
        "() => /failed/.test(document.getElementById('sidebar-note').textContent)"
    )
    assert page.locator("#conversations li").count() == 5
    page.context.close()


def test_live_numbers_while_a_reply_streams(browser, server):
    fake = server.fake
    page = open_page(browser, server)
    fake.reply, fake.delay = " ".join(f"w{i}" for i in range(300)), 0.02
    send(page, "Go on for a while")
    page.wait_for_selector(".message.streaming")
    pattern = re.compile(r"(\d+) tokens · ([\d.]+) tok/s · context (\d+) of 2048")
    page.wait_for_function(
        "() => /tok\\/s/.test(document.querySelector('.message.streaming .stats').textContent)"
    )
    first = pattern.search(page.locator(".message.streaming .stats").inner_text())
    gauge_first = page.locator("#gauge .label").inner_text()
    page.wait_for_timeout(600)
    second = pattern.search(page.locator(".message.streaming .stats").inner_text())
    assert first and second, page.locator(".message.streaming .stats").inner_text()
    assert int(second.group(1)) > int(first.group(1)) > 0
    assert int(second.group(3)) > int(first.group(3))
    assert float(second.group(2)) > 0
    assert page.locator("#gauge .label").inner_text() != gauge_first  # the gauge moves too
    page.click("#stop")
    wait_reply_done(page)
    done = page.locator(".message.assistant .stats").inner_text()
    assert re.search(r"\d+ tokens · reused \d+ of \d+ prompt tokens · stopped", done), done
    fake.delay = 0.002
    page.context.close()


def test_new_chat_reuses_an_empty_one(browser, server):
    page = open_page(browser, server)
    start = page.locator("#conversations li").count()
    page.click("#new-chat")
    page.click("#new-chat")
    assert page.locator("#conversations li").count() == start  # the empty one is reused
    send(page, "something")
    wait_reply_done(page)
    page.click("#new-chat")
    page.click("#new-chat")
    assert page.locator("#conversations li").count() == start + 1
    page.context.close()


def test_phone_sidebar_closes_and_the_placeholder_fits(browser, server, tmp_path):
    page = open_page(browser, server, viewport=PHONE, mobile=True)
    send(page, "A question from a phone")
    wait_reply_done(page)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    page.screenshot(path=str(tmp_path / "phone.png"))
    fits = page.evaluate(
        """() => {
        const input = document.getElementById('input');
        const style = getComputedStyle(input);
        const ctx = document.createElement('canvas').getContext('2d');
        ctx.font = style.font;
        const pad = parseFloat(style.paddingLeft) + parseFloat(style.paddingRight);
        const room = input.clientWidth - pad;
        return ctx.measureText(input.placeholder).width <= room;
    }"""
    )
    assert fits

    def sidebar_open():
        box = page.locator("#sidebar").bounding_box()
        return box["x"] + box["width"] > 1

    page.tap("#toggle-sidebar")
    page.wait_for_timeout(300)
    assert sidebar_open()
    page.screenshot(path=str(tmp_path / "phone-sidebar.png"))
    page.touchscreen.tap(PHONE["width"] - 20, PHONE["height"] // 2)  # outside the sidebar
    page.wait_for_timeout(300)
    assert not sidebar_open()
    assert page.is_visible("#toggle-sidebar")
    page.tap("#toggle-sidebar")
    page.wait_for_timeout(300)
    page.tap("#new-chat")
    page.wait_for_timeout(300)
    assert not sidebar_open()
    menu = page.locator("#toggle-sidebar").bounding_box()
    # Nothing covers the menu button: it is what a tap at its centre reaches.
    hit = page.evaluate(
        "([x, y]) => document.elementFromPoint(x, y).id",
        [menu["x"] + menu["width"] / 2, menu["y"] + menu["height"] / 2],
    )
    assert hit == "toggle-sidebar"
    assert not page.errors
    page.context.close()
