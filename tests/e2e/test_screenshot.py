"""The real model behind the real page: two turns, the second reusing the first's K/V,
a regenerated reply (a branch), then a reload and a third turn of the same conversation
(the browser still owns it). The screenshot shows highlighted code, a table and the
branch selector.
With PARLEY_WRITE_SCREENSHOT=1 it refreshes the README's screenshot (docs/screenshot.png);
otherwise it writes nothing into the repository."""

import os
import re
from pathlib import Path

from app.config import CacheConfig, EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.server.app import create_app
from tests.e2e.live_server import live_server

README_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "screenshot.png"


def wait_for_replies(page, n: int) -> None:
    page.wait_for_function(
        "n => document.querySelectorAll('.message.assistant').length === n"
        " && !document.querySelector('.message.streaming')"
        " && !document.querySelector('.message.assistant .bubble:not(.rendered)')",
        arg=n,
        timeout=120_000,
    )


def test_real_model_chat_reuses_kv_and_screenshot(smollm, browser, tmp_path):
    write_readme = os.environ.get("PARLEY_WRITE_SCREENSHOT") == "1"
    screenshot = README_SCREENSHOT if write_readme else tmp_path / "screenshot.png"
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(128 << 20)), smollm))
    with live_server(create_app(engine=engine)) as server:
        page = browser.new_page(viewport={"width": 1100, "height": 980})
        page.goto(server.url)
        page.wait_for_selector("#connection[data-state=open]")
        page.click("#toggle-settings")
        page.fill("#setting-temperature", "0")
        page.fill("#setting-max-tokens", "90")
        page.dispatch_event("#setting-temperature", "change")
        page.dispatch_event("#setting-max-tokens", "change")
        page.click("#toggle-settings")
        for i, question in enumerate(
            [
                "Write a Python function that returns the n-th Fibonacci number.",
                "Make a markdown table of three fruits and their colors.",
            ]
        ):
            page.fill("#input", question)
            page.press("#input", "Enter")
            wait_for_replies(page, i + 1)
        stats = page.locator(".message.assistant .stats").all_inner_texts()
        reused = re.search(r"reused (\d+) of (\d+)", stats[-1])
        assert reused and int(reused.group(1)) > 0.8 * int(reused.group(2))
        bubbles = page.locator(".message.assistant .bubble")
        assert bubbles.first.locator("pre code span").count() > 0  # highlighted code
        assert bubbles.last.locator("table td").count() > 0  # a table
        # A second version of the last reply: the branch selector.
        page.click(".message.assistant >> nth=-1 >> .regenerate")
        wait_for_replies(page, 2)
        assert page.locator(".message.assistant .branches .position").inner_text() == "2/2"
        page.wait_for_timeout(300)
        page.screenshot(path=str(screenshot))

        # A reload keeps the browser's lineage (its cookie): the conversation is still
        # its own, and its next turn reuses the pinned K/V.
        page.reload()
        page.wait_for_selector("#connection[data-state=open]")
        page.fill("#input", "Thank you!")
        page.press("#input", "Enter")
        wait_for_replies(page, 3)
        assert not page.locator(".message.assistant .error").count()
        stats = page.locator(".message.assistant .stats").all_inner_texts()
        reused = re.search(r"reused (\d+) of (\d+)", stats[-1])
        assert reused and int(reused.group(1)) > 0.8 * int(reused.group(2))
        page.close()
    assert screenshot.stat().st_size > 10_000
