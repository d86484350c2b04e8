"""Hermes-style tool calls, as Hermes, Qwen 2.5 and Qwen 3 templates teach them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them.
Text streams as it comes (what may still become `<tool_call>` is held back); a call's
arguments stream as the model writes them."""

from __future__ import annotations

from app.chat.formats.events import CallArgs, CallDone, CallStart, Event, Text
from app.chat.formats.held import held_back
from app.chat.formats.json_call import JsonCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesCalls:
    def __init__(self) -> None:
        self._pending = ""  # text not yet sent: a possible marker, or trailing space
        self._call: JsonCall | None = None
        self._count = 0
        self._started = False  # some text was sent (leading space is dropped before)
        self._space = ""  # trailing whitespace not sent yet

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while True:
            if self._call is None:
                at = self._pending.find(OPEN)
                if at < 0:
                    keep = held_back(self._pending, (OPEN,))
                    events += self._text(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    return events
                events += self._text(self._pending[:at])
                self._pending = self._pending[at + len(OPEN) :]
                self._call = JsonCall(self._count)
            at = self._pending.find(CLOSE)
            body = self._pending if at < 0 else self._pending[:at]
            keep = held_back(body, (CLOSE,)) if at < 0 else 0
            got, _ = self._call.feed(body[: len(body) - keep])
            events += got
            if at < 0:
                self._pending = body[len(body) - keep :]
                return events
            events += self._end_call()
            self._pending = self._pending[at + len(CLOSE) :]

    def _end_call(self) -> list[Event]:
        assert self._call is not None
        call, self._call = self._call, None
        events = call.done()
        if any(isinstance(e, CallDone) for e in events):
            self._count += 1
            return events
        # Not a call object: it stays in the text, as the model wrote it.
        started = [e for e in events if isinstance(e, (CallStart, CallArgs))]
        return [*started, *self._text(OPEN + call.raw + CLOSE)]

    def _text(self, text: str) -> list[Event]:
        """Text to send. Whitespace at the start of the reply is dropped, and trailing
        whitespace waits for what follows: space before a call or at the end of the
        reply is not content."""
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        out, self._space = self._space + body, text[len(body) :]
        self._started = True
        return [Text(out)]

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._call is not None:
            got, _ = self._call.feed(self._pending)
            events += got + self._call.done()
            if not any(isinstance(e, CallDone) for e in events):
                events += self._text(OPEN + self._call.raw)
            self._call = None
        else:
            events += self._text(self._pending)
        self._pending = ""
        return events
