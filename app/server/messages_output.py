"""An Anthropic Messages reply as content blocks (thinking, text, tool_use): the message,
and the Server-Sent Events that stream each block as the reply's format parser
(app.chat.formats) finds it."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from app.chat.formats import CallArgs, CallDone, CallStart, Event, Reasoning, Text
from app.engine.request import FinishReason
from app.server.api_turn import APISurface, Generation, Produced, matched_stop, reply_stream
from app.server.errors import APIError
from app.server.openai_request import ToolUse


class MessageShape:
    """One reply's message and events."""

    def __init__(
        self, api: APISurface, tools: ToolUse | None, stops: list[str], thinking: bool
    ) -> None:
        self.api = api
        self.tools = tools
        self.stops = stops
        self.thinking = thinking
        self.id = "msg_" + uuid.uuid4().hex

    def _stop(self, done: Produced, calls: bool) -> tuple[str, str | None]:
        last = done.last
        assert last is not None
        if calls:
            return "tool_use", None
        if last.finish_reason is FinishReason.LENGTH:
            return "max_tokens", None
        stop = matched_stop(self.api.chat, done, self.stops)
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)

    def _head(self, content: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.api.model_name,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }

    async def message(self, gen: Generation) -> dict[str, Any]:
        done = await gen.collect()
        if done.failed or done.last is None:
            raise APIError(500, "the engine failed this request", "server_error")
        blocks = _Blocks()
        stream = reply_stream(self.api.format, self.tools, self.thinking)
        for event in stream.feed(done.text) + stream.finish():
            blocks.apply(event)
        blocks.close()
        reason, stop = self._stop(done, blocks.has_calls)
        last = done.last
        out = self._head(
            blocks.content, _usage(last.prompt_tokens, last.cached_tokens, last.completion_tokens)
        )
        return {**out, "stop_reason": reason, "stop_sequence": stop}

    async def events(self, gen: Generation, prompt: int, cached: int) -> AsyncIterator[str]:
        yield _event("message_start", message=self._head([], _usage(prompt, cached, 0)))
        yield _event("ping")
        blocks = _Blocks()
        stream = reply_stream(self.api.format, self.tools, self.thinking)
        # Closed as soon as this stream ends or is left (a client gone): the request is
        # aborted and the conversation freed then, not when the generator is collected.
        async with contextlib.aclosing(gen.outputs()) as outputs:
            async for out in outputs:
                if out.finish_reason is FinishReason.ERROR:
                    break
                for event in stream.feed(out.new_text):
                    for line in blocks.apply(event):
                        yield line
        done = gen.produced
        if done.failed or done.last is None:
            error = {"type": "api_error", "message": "the engine failed this request"}
            yield _event("error", error=error)
            return
        for event in stream.finish():
            for line in blocks.apply(event):
                yield line
        for line in blocks.close():
            yield line
        reason, stop = self._stop(done, blocks.has_calls)
        yield _event(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": stop},
            usage={"output_tokens": done.last.completion_tokens},
        )
        yield _event("message_stop")


class _Blocks:
    """Content blocks as the reply's events arrive (thinking, text, tool_use), with the
    events that stream them."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # call index -> its block
        self._json: dict[int, str] = {}  # call index -> its arguments so far

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def _start(self, block: dict[str, Any]) -> list[str]:
        lines = self.close(at_end=False)
        self.content.append(block)
        self.open = block
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [
            *lines,
            _event("content_block_start", index=len(self.content) - 1, content_block=shown),
        ]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=len(self.content) - 1, delta=delta)

    def apply(self, event: Event) -> list[str]:
        if isinstance(event, Reasoning):
            lines = []
            if self.open is None or self.open["type"] != "thinking":
                lines = self._start({"type": "thinking", "thinking": "", "signature": ""})
            assert self.open is not None
            self.open["thinking"] += event.text
            return [*lines, self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, Text):
            lines = []
            if self.open is None or self.open["type"] != "text":
                lines = self._start({"type": "text", "text": ""})
            assert self.open is not None
            self.open["text"] += event.text
            return [*lines, self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStart):
            block = {
                "type": "tool_use",
                "id": "toolu_" + event.id.removeprefix("call_"),
                "name": event.name,
                "input": {},
            }
            self.calls[event.index] = block
            self._json[event.index] = ""
            return self._start(block)
        if isinstance(event, CallArgs):
            self._json[event.index] += event.text
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        assert isinstance(event, CallDone)
        self.calls[event.index]["input"] = _input(event.call.arguments)
        return self.close(at_end=False)

    def close(self, at_end: bool = True) -> list[str]:
        block, self.open = self.open, None
        if block is None:
            if at_end and not self.content:  # an empty reply: one empty text block
                return [*self._start({"type": "text", "text": ""}), *self.close()]
            return []
        return [_event("content_block_stop", index=self.content.index(block))]


def _event(kind: str, **data: Any) -> str:
    payload = {"type": kind, **data}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    # Anthropic's input_tokens are the prompt tokens not read from the cache.
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }
