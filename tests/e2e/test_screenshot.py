"""The real model behind the real page: two turns, the second reusing the first's K/V.
Saves the screenshot the README shows (docs/screenshot.png)."""

import re
from pathlib import Path

import pytest

from app.config import CacheConfig, EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.server.app import create_app
from tests.e2e.live_server import live_server

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "screenshot.png"


def test_real_model_chat_reuses_kv_and_screenshot(smollm, browser):
    engine = AsyncEngine(LLMEngine(EngineConfig(cache=CacheConfig(128 << 20)), smollm))
    with live_server(create_app(engine=engine)) as server:
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        page.goto(server.url)
        page.wait_for_selector("#connection[data-state=open]")
        page.click("#toggle-settings")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "80")
        page.dispatch_event("#temperature", "change")
        page.dispatch_event("#max-tokens", "change")
        page.click("#toggle-settings")
        for i, question in enumerate(
            [
                "Write a Python function that returns the n-th Fibonacci number.",
                "Now explain in one sentence how it works.",
            ]
        ):
            page.fill("#input", question)
            page.press("#input", "Enter")
            page.wait_for_function(
                "n => document.querySelectorAll('.message.assistant').length === n"
                " && !document.querySelector('.message.streaming')",
                arg=i + 1,
                timeout=120_000,
            )
        stats = page.locator(".message.assistant .stats").all_inner_texts()
        reused = re.search(r"reused (\d+) of (\d+)", stats[-1])
        assert reused and int(reused.group(1)) > 0.8 * int(reused.group(2))
        assert page.locator(".message.assistant .bubble").first.inner_text().strip()
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))
        page.close()
    if not SCREENSHOT.exists():
        pytest.fail("no screenshot written")
