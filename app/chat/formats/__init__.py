"""Tool-call and reasoning formats per model family: how a reply's text becomes content,
reasoning and tool calls, parsed as it streams.

Which format a model writes is read off its chat template (the template teaches it):

- Hermes `<tool_call>{json}</tool_call>` (Hermes, Qwen 2.5, Qwen 3; and any template that
  renders tools without naming another format): hermes.py
- Llama 3.x JSON calls, `{"name": ..., "parameters": {...}}` after `<|python_tag|>` or
  alone: json_call.py
- Python calls, `[f(a=1)]` or a ```tool_code fence (Gemma's tool prompts): pythonic.py
- `<think>` reasoning before the answer (Qwen 3, DeepSeek R1 distills): reasoning.py

A forced tool_choice ("required" or a named function) makes the reply one JSON call object
by the grammar engine (app.chat.tools.forced_call_schema), whatever the family: that reply
is read by json_call.py too.

ChatFormat.stream() gives a parser to feed the reply's text deltas to; each feed returns
events (app.chat.formats.events): text, reasoning, a call's start, its argument deltas,
its end. ChatFormat.parse() is the same over a whole reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from app.chat.formats.events import (
    CallArgs,
    CallDone,
    CallStart,
    Event,
    Parsed,
    Reasoning,
    Text,
)
from app.chat.formats.hermes import HermesCalls
from app.chat.formats.json_call import JsonCalls
from app.chat.formats.pythonic import PythonicCalls
from app.chat.formats.reasoning import PlainText, ThinkSplitter

__all__ = [
    "CallArgs",
    "CallDone",
    "CallStart",
    "ChatFormat",
    "Event",
    "Parsed",
    "Reasoning",
    "ReplyStream",
    "Text",
]

TOOL_FORMATS = ("hermes", "llama3_json", "pythonic")
EFFORTS = ("none", "minimal", "low", "medium", "high")


class _Parser(Protocol):
    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...


class ReplyStream:
    """Feed a reply's text deltas; get events. `parallel=False` keeps the first call."""

    def __init__(self, parser: _Parser, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel

    def feed(self, text: str) -> list[Event]:
        return self._keep(self.parser.feed(text)) if text else []

    def finish(self) -> list[Event]:
        return self._keep(self.parser.finish())

    def _keep(self, events: list[Event]) -> list[Event]:
        if self.parallel:
            return events
        return [
            e for e in events if not isinstance(e, (CallStart, CallArgs, CallDone)) or e.index == 0
        ]


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(template.values())
    return template


@dataclass(frozen=True)
class ChatFormat:
    """What a model's replies look like: its tool-call format (None: it renders no tools),
    whether it reasons in <think>, and how a request may set its reasoning effort."""

    tools: str | None = None  # one of TOOL_FORMATS
    reasoning: bool = False
    think_opened: bool = False  # the generation prompt opens <think>: the reply starts inside
    effort_control: str | None = None  # "enable_thinking" or "reasoning_effort" (a kwarg)

    @classmethod
    def of(cls, tokenizer: Any) -> ChatFormat:
        template = _template_text(tokenizer)
        tools = None
        if "tools" in template:
            if "<tool_call>" in template:
                tools = "hermes"
            elif "<|python_tag|>" in template or "ipython" in template:
                tools = "llama3_json"
            elif "tool_code" in template:
                tools = "pythonic"
            else:
                tools = "hermes"
        reasoning = "<think>" in template
        control = None
        if "reasoning_effort" in template:
            control = "reasoning_effort"
        elif "enable_thinking" in template:
            control = "enable_thinking"
        opened = reasoning and _opens_think(tokenizer)
        return cls(tools, reasoning, opened, control)

    def template_args(self, effort: str | None) -> dict[str, Any]:
        """The chat template's arguments for a request's reasoning_effort. Raises
        ValueError when the template offers no control, or the value is not one."""
        if effort is None:
            return {}
        if self.effort_control is None:
            raise ValueError(
                "this model's chat template has no reasoning control: "
                "reasoning_effort cannot be honoured"
            )
        if effort not in EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORTS)}")
        if self.effort_control == "enable_thinking":
            return {"enable_thinking": effort not in ("none", "minimal")}
        return {"reasoning_effort": effort}

    def stream(
        self, tool_mode: str | None = None, parallel: bool = True, thinking: bool = True
    ) -> ReplyStream:
        """A parser for one reply. `tool_mode`: None (no tools), "auto" or "forced"."""
        if tool_mode == "forced":
            parser: _Parser = JsonCalls(single=True)
        elif tool_mode == "auto":
            parser = {"hermes": HermesCalls, "llama3_json": JsonCalls, "pythonic": PythonicCalls}[
                self.tools or "hermes"
            ]()
        else:
            parser = PlainText()
        if self.reasoning and tool_mode != "forced":
            parser = ThinkSplitter(parser, self.think_opened and thinking)
        return ReplyStream(parser, parallel)

    def parse(
        self, text: str, tool_mode: str | None = None, parallel: bool = True, thinking: bool = True
    ) -> Parsed:
        stream = self.stream(tool_mode, parallel, thinking)
        return Parsed().add(stream.feed(text) + stream.finish())


def _opens_think(tokenizer: Any) -> bool:
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that wants more than one message: assume not
        return False
    return text.rstrip().endswith("<think>")
