"""A Chromium for the browser tests of a module (skipped where Chromium is missing)."""

import pytest

from tests.e2e.live_server import CHROMIUM, CHROMIUM_ARGS, chromium_or_skip


@pytest.fixture(scope="module")
def browser():
    sync_api = chromium_or_skip()
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()
