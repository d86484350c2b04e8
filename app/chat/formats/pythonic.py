"""Python-call tool calls, as Gemma's tool-use prompts (and Llama 3.2's) teach them: a
reply that is `[get_weather(city="Paris"), ...]`, or the same inside a ```tool_code
fence. The calls are Python expressions, read with `ast` once the reply is complete (a
prefix of one is not Python yet): their arguments arrive as one delta each."""

from __future__ import annotations

import ast
import json
import re

from app.chat.formats.events import CallArgs, CallDone, CallStart, Event, Text
from app.chat.formats.json_call import new_call_id
from app.chat.tools import ToolCall

_FENCE = re.compile(r"^```(?:tool_code|tool_call|python)?\s*(.*?)\s*```\s*$", re.DOTALL)
_STARTS = ("[", "```")


class PythonicCalls:
    def __init__(self) -> None:
        self._buffer = ""
        self._mode = "start"  # start -> calls (held to the end) | text

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [Text(text)] if text else []
        self._buffer += text
        head = self._buffer.lstrip()
        if self._mode == "start" and head:
            if any(head.startswith(s) or s.startswith(head) for s in _STARTS):
                if len(head) >= 3 or head.startswith("["):
                    self._mode = "calls"
                return []
            self._mode = "text"
            out, self._buffer = head, ""
            return [Text(out)]
        return []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer.strip(), ""
        if self._mode == "text" or not text:
            return []
        calls = parse_pythonic(text)
        if calls is None:
            return [Text(text)]
        events: list[Event] = []
        for i, call in enumerate(calls):
            events += [CallStart(i, call.id, call.name), CallArgs(i, call.arguments),
                       CallDone(i, call)]  # fmt: skip
        return events


def parse_pythonic(text: str) -> list[ToolCall] | None:
    """The calls of `[f(a=1), g()]` (fenced or not), or None when it is not that."""
    fenced = _FENCE.match(text)
    source = fenced.group(1) if fenced else text
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        return None
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in item.keywords if kw.arg}
        except ValueError:
            return None
        calls.append(ToolCall(new_call_id(), item.func.id, json.dumps(args, ensure_ascii=False)))
    return calls
