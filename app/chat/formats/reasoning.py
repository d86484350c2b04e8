"""`<think>` reasoning (Qwen 3, DeepSeek R1 and the models distilled from them): what a
reply writes between `<think>` and `</think>` is its reasoning, returned apart from its
content (/v1's reasoning_content, the Responses API's reasoning items, Anthropic's thinking
blocks). A template whose generation prompt opens the think block itself starts the reply
inside it. Space around the reasoning and before the answer is neither's."""

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
        self._thought = False  # reasoning text was sent (leading space is dropped before)
        self._answered = False  # text after the reasoning was passed on

    def feed(self, text: str) -> list[Event]:
        if self._mode == "after":
            return self._answer(text)
        self._pending += text
        if self._mode == "start":
            head = self._pending.lstrip()
            if OPEN.startswith(head):
                return []  # may still become <think>
            if not head.startswith(OPEN):
                self._mode = "after"
                out, self._pending = self._pending, ""
                self._answered = True  # no reasoning: the text is the model's, as it is
                return self.inner.feed(out)
            self._pending = head[len(OPEN) :]
            self._mode = "inside"
        at = self._pending.find(CLOSE)
        if at < 0:
            keep = held_back(self._pending, (CLOSE,))
            out = self._pending[: len(self._pending) - keep]
            body = out.rstrip()
            self._pending = out[len(body) :] + self._pending[len(self._pending) - keep :]
            return self._thinking(body)
        out, rest = self._pending[:at].rstrip(), self._pending[at + len(CLOSE) :]
        self._pending, self._mode = "", "after"
        return self._thinking(out) + self._answer(rest)

    def _thinking(self, text: str) -> list[Event]:
        if not self._thought:
            text = text.lstrip()
        if not text:
            return []
        self._thought = True
        return [Reasoning(text)]

    def _answer(self, text: str) -> list[Event]:
        if not self._answered:
            text = text.lstrip()
            if not text:
                return []
            self._answered = True
        return self.inner.feed(text)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._pending:
            if self._mode == "inside":
                events += self._thinking(self._pending.rstrip())
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
