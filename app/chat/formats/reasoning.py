"""`<think>` reasoning (Qwen 3, DeepSeek R1 and the models distilled from them): what a
reply writes between `<think>` and `</think>` is its reasoning, returned apart from its
content (/v1's reasoning_content, the Responses API's reasoning items). A template whose
generation prompt opens the think block itself starts the reply inside it."""

from __future__ import annotations

from app.chat.formats.events import Event, Reasoning, Text
from app.chat.formats.held import held_back

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """Reasoning first, then the rest to `inner` (a tool-call stream, or plain text)."""

    def __init__(self, inner, open_at_start: bool = False) -> None:
        self.inner = inner
        self._mode = "inside" if open_at_start else "start"  # start | inside | after
        self._pending = ""

    def feed(self, text: str) -> list[Event]:
        if self._mode == "after":
            return self.inner.feed(text)
        self._pending += text
        if self._mode == "start":
            head = self._pending.lstrip()
            if OPEN.startswith(head):
                return []  # may still become <think>
            if not head.startswith(OPEN):
                self._mode = "after"
                out, self._pending = self._pending, ""
                return self.inner.feed(out)
            self._pending = head[len(OPEN) :].lstrip("\n")
            self._mode = "inside"
        at = self._pending.find(CLOSE)
        if at < 0:
            keep = held_back(self._pending, (CLOSE,))
            out = self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep :]
            return [Reasoning(out)] if out else []
        out, rest = self._pending[:at], self._pending[at + len(CLOSE) :].lstrip()
        self._pending, self._mode = "", "after"
        events: list[Event] = [Reasoning(out.rstrip("\n"))] if out.rstrip("\n") else []
        return events + (self.inner.feed(rest) if rest else [])

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._pending:
            if self._mode == "inside":
                events.append(Reasoning(self._pending))
            else:
                events += self.inner.feed(self._pending)
            self._pending = ""
        return events + self.inner.finish()


class PlainText:
    """No tool calls: the text as it is."""

    def feed(self, text: str) -> list[Event]:
        return [Text(text)] if text else []

    def finish(self) -> list[Event]:
        return []
