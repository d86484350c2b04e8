"""A real uvicorn server on 127.0.0.1 in a background thread, and a headless Chromium."""

from __future__ import annotations

import os
import shutil
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


class LiveServer:
    def __init__(self, app, port: int = 0, **options) -> None:
        """`options` go to uvicorn.Config (e.g. ssl_certfile and ssl_keyfile: https)."""
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options)
        self.scheme = "https" if options.get("ssl_certfile") else "http"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "server did not stop"


@contextmanager
def live_server(app, port: int = 0, **options):
    server = LiveServer(app, port, **options).start()
    try:
        yield server
    finally:
        server.stop()


def chromium_or_skip():
    """Launch Debian's chromium through Playwright; skip if absent (unless required:
    CI sets PARLEY_REQUIRE_BROWSER=1 so that a missing browser fails instead)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which(CHROMIUM):
        if os.environ.get("PARLEY_REQUIRE_BROWSER"):
            pytest.fail(f"{CHROMIUM} is missing (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} is not installed")
    return sync_api


def browser_cookie(url: str) -> dict[str, str]:
    """The Cookie header a browser would send after loading the page: its lineage, which
    owns the conversations it starts (for clients that have no cookie jar of their own)."""
    import httpx

    page = httpx.get(url + "/")
    return {"Cookie": "; ".join(f"{k}={v}" for k, v in page.cookies.items())}
