"""One JSON call object, `{"name": ..., "arguments": {...}}` ("parameters" in Llama 3.x's
format), scanned as it is produced: its name as soon as it is complete, then its
arguments' text as it comes, then the end of the object.

The arguments stream as the model wrote them, and the call's final `arguments` is that
same text, so that a client adding up the deltas holds exactly the final call. An object
written in another order (arguments before the name) is parsed whole at its end.
"""

from __future__ import annotations

import json
import re
import uuid

from app.chat.formats.events import CallArgs, CallDone, CallStart, Event, Text
from app.chat.tools import ToolCall, parse_forced_call

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class JsonCall:
    """Feed it the text of one call object; it says what became known."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_call_id()
        self.raw = ""
        self.name: str | None = None
        self._args_at: int | None = None  # where the arguments' value starts in `raw`
        self._args_end: int | None = None  # ... and ends (exclusive), once complete
        self._sent = 0  # characters of the arguments sent
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.closed = False  # the object's closing brace was seen

    def feed(self, text: str) -> tuple[list[Event], str]:
        """Events, and what of `text` lies past the end of the object (unconsumed)."""
        events: list[Event] = []
        self.raw += text
        if self.name is None:
            m = _HEAD.match(self.raw)
            # Known once the value has begun: space after the colon may still be coming.
            if m is not None and m.end() < len(self.raw):
                self.name = json.loads(f'"{m.group(1)}"')
                self._args_at = m.end()
                events.append(CallStart(self.index, self.id, self.name))
        rest = self._scan()
        if rest is not None:
            self.raw, tail = self.raw[:rest], self.raw[rest:]
        else:
            tail = ""
        if self._args_at is not None and self._args_at < self._scanned:
            end = self._args_end if self._args_end is not None else self._scanned
            piece = self.raw[self._args_at + self._sent : end]
            if piece:
                self._sent += len(piece)
                events.append(CallArgs(self.index, piece))
        return events, tail

    def _scan(self) -> int | None:
        """Track braces and strings; the offset just past the object once it closed."""
        raw = self.raw
        i = self._scanned
        while i < len(raw) and not self.closed:
            c = raw[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and self._args_open(i):
                    self._args_end = i + 1
                self.closed = self._depth == 0
            elif c == "," and self._depth == 1 and self._args_open(i):
                self._args_end = i  # a scalar or string value ended
            i += 1
        self._scanned = i
        return i if self.closed else None

    def _args_open(self, i: int) -> bool:
        return self._args_at is not None and self._args_end is None and i >= self._args_at

    def done(self) -> list[Event]:
        """The object ended (or the reply did): the call, if it is one."""
        events: list[Event] = []
        if self.name is not None and self._args_at is not None:
            end = self._args_end if self._args_end is not None else self._scanned
            if self._args_end is None:  # cut short (max_tokens): what arrived so far
                events.extend(self._flush(end))
            text = self.raw[self._args_at : end]
            events.append(CallDone(self.index, ToolCall(self.id, self.name, text)))
            return events
        calls = parse_forced_call(self.raw.strip())  # another key order: parse it whole
        if calls:
            call = ToolCall(self.id, calls[0].name, calls[0].arguments)
            events += [
                CallStart(self.index, self.id, call.name),
                CallArgs(self.index, call.arguments),
                CallDone(self.index, call),
            ]
        return events

    def _flush(self, end: int) -> list[Event]:
        assert self._args_at is not None
        piece = self.raw[self._args_at + self._sent : end]
        self._sent += len(piece)
        return [CallArgs(self.index, piece)] if piece else []


class JsonCalls:
    """A reply that is JSON call objects (Llama 3.x's format, optionally after
    <|python_tag|> and separated by ";", and the one object a forced tool_choice makes):
    a reply that does not begin with "{" is text."""

    PREFIX = "<|python_tag|>"

    def __init__(self, single: bool = False) -> None:
        self.single = single
        self._mode = "start"  # start -> calls | text
        self._pending = ""
        self._call: JsonCall | None = None
        self._count = 0

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [Text(text)] if text else []
        if self._mode == "after":
            return []
        self._pending += text
        events: list[Event] = []
        while self._pending:
            if self._call is None:
                head = self._pending.lstrip().removeprefix(self.PREFIX).lstrip().lstrip(";")
                head = head.lstrip()
                if not head:
                    return events
                if self.PREFIX.startswith(head) and self._mode == "start":
                    return events  # may be the python tag, still arriving
                if head[0] != "{":
                    if self._mode == "start":
                        self._mode = "text"
                        out, self._pending = self._pending, ""
                        return [*events, Text(out)]
                    self._pending = ""  # after the calls: nothing more to show
                    return events
                self._mode = "calls"
                self._call = JsonCall(self._count)
                self._pending = head
            got, tail = self._call.feed(self._pending)
            events += got
            self._pending = tail
            if not self._call.closed:
                self._pending = ""
                return events
            events += self._call.done()
            self._count += 1
            self._call = None
            if self.single:
                self._mode = "after"  # one call and nothing else
                self._pending = ""
                return events
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._call is not None:
            events += self._call.done()
            if not events and self._count == 0:
                events.append(Text(self._call.raw))
            self._call = None
        elif self._pending and self._mode == "start":
            events.append(Text(self._pending))
        self._pending = ""
        return events
