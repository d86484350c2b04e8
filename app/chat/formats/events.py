"""What a reply's text turns into as it streams: text, reasoning, and tool calls (a call
starts with its name, its arguments follow as deltas, then it is done)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.chat.tools import ToolCall


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # of the reply's calls, from 0
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallDone:
    index: int
    call: ToolCall  # its arguments are what the CallArgs deltas added up to


Event = Text | Reasoning | CallStart | CallArgs | CallDone


@dataclass
class Parsed:
    """A whole reply, parsed: what /v1 puts in content, reasoning and tool_calls."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> Parsed:
        for e in events:
            if isinstance(e, Text):
                self.content += e.text
            elif isinstance(e, Reasoning):
                self.reasoning += e.text
            elif isinstance(e, CallDone):
                self.calls.append(e.call)
        return self
