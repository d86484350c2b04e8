"""/health, asked every few milliseconds on a thread of its own while something else runs:
whether it answered every time (within a generous timeout), and how long it took at most.
The event loop answers /health; a request that blocks the loop shows here."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx


@dataclass
class HealthWatch:
    answered: int = 0
    slowest_s: float = 0.0
    failures: list[str] = field(default_factory=list)


@contextmanager
def health_watch(base_url: str, timeout_s: float = 5.0, every_s: float = 0.02):
    """Watch /health for the duration of the block; the HealthWatch fills in as it runs."""
    watch = HealthWatch()
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=timeout_s) as client:
            while not stop.is_set():
                began = time.perf_counter()
                try:
                    ok = client.get(base_url + "/health").status_code == 200
                except httpx.HTTPError as exc:
                    watch.failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                watch.slowest_s = max(watch.slowest_s, time.perf_counter() - began)
                watch.answered += ok
                stop.wait(every_s)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not watch.answered and not watch.failures and time.monotonic() < deadline:
        time.sleep(0.005)  # it answers before the block begins, and during it
    began = watch.answered
    try:
        yield watch
    finally:
        deadline = time.monotonic() + timeout_s
        while watch.answered == began and not watch.failures and time.monotonic() < deadline:
            time.sleep(0.005)  # ... and once more after it ends
        stop.set()
        thread.join(timeout_s + 5)
