"""A Responses API reply as output items (reasoning, a message, function calls): the
response object, and the Server-Sent Events that announce each item as the reply's
format parser (app.chat.formats) finds it."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.chat.formats import CallArgs, CallDone, CallStart, Event, Parsed, Reasoning, Text
from app.engine.request import FinishReason
from app.server.api_turn import APISurface, Generation, Produced, reply_stream
from app.server.openai_request import ToolUse


class ResponseShape:
    """One response's object and events, from the request and what the reply produced."""

    def __init__(
        self,
        api: APISurface,
        body: dict[str, Any],
        tools: ToolUse | None,
        previous_id: str | None,
        thinking: bool,
    ) -> None:
        self.api = api
        self.body = body
        self.tools = tools
        self.thinking = thinking
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.previous_id = previous_id
        self.parsed = Parsed()

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        done: Produced | None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        b = self.body
        text_format = (b.get("text") or {}).get("format") or {"type": "text"}
        error = None
        if status == "failed":
            error = {"code": "server_error", "message": "the engine failed this response"}
        effort = (b.get("reasoning") or {}).get("effort")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "model": self.api.model_name,
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
            "previous_response_id": self.previous_id,
            "reasoning": {"effort": effort, "summary": None},
            "store": b.get("store", True),
            "temperature": b.get("temperature", 1.0),
            "text": {"format": text_format},
            "tool_choice": b.get("tool_choice") or "auto",
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p", 1.0),
            "truncation": b.get("truncation") or "disabled",
            "usage": self._usage(done) if done and done.last else None,
            "user": b.get("user"),
            "metadata": b.get("metadata") or {},
        }

    def _usage(self, done: Produced) -> dict[str, Any]:
        last = done.last
        assert last is not None
        # Reasoning tokens: those of the reasoning text (near enough: the <think> markers
        # and a token that straddles its end are not counted).
        reasoning = self.parsed.reasoning
        tokenizer = self.api.chat.prompt.tokenizer
        thought = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {
            "input_tokens": last.prompt_tokens,
            "input_tokens_details": {"cached_tokens": last.cached_tokens},
            "output_tokens": last.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(thought, last.completion_tokens)},
            "total_tokens": last.prompt_tokens + last.completion_tokens,
        }

    def final(self, done: Produced, output: list[dict[str, Any]]) -> dict[str, Any]:
        if done.failed:
            return self.response("failed", [], done)
        last = done.last
        cut = last is not None and last.finish_reason is FinishReason.LENGTH
        incomplete = "max_output_tokens" if cut else None
        return self.response("incomplete" if cut else "completed", output, done, incomplete)

    async def whole(self, gen: Generation) -> tuple[Produced, dict[str, Any]]:
        done = await gen.collect()
        items = _Items(self)
        stream = reply_stream(self.api.format, self.tools, self.thinking)
        for event in stream.feed(done.text) + stream.finish():
            items.apply(event)
        items.close()
        return done, self.final(done, items.output)

    async def events(
        self, gen: Generation, keep: Callable[[Produced, dict[str, Any]], None]
    ) -> AsyncIterator[str]:
        items = _Items(self)
        started = self.response("in_progress", [], None)
        yield items.sse("response.created", response=started)
        yield items.sse("response.in_progress", response=started)
        stream = reply_stream(self.api.format, self.tools, self.thinking)
        # Closed as soon as this stream ends or is left (a client gone): the request is
        # aborted and the conversation freed then, not when the generator is collected.
        async with contextlib.aclosing(gen.outputs()) as outputs:
            async for out in outputs:
                if out.finish_reason is FinishReason.ERROR:
                    break
                for event in stream.feed(out.new_text):
                    for line in items.apply(event):
                        yield line
        done = gen.produced
        if done.failed:
            yield items.sse("response.failed", response=self.final(done, []))
            return
        for event in stream.finish():
            for line in items.apply(event):
                yield line
        for line in items.close():
            yield line
        final = self.final(done, items.output)
        keep(done, final)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield items.sse(kind, response=final)


class _Items:
    """Output items as the reply's events arrive (reasoning, a message, function calls),
    with the Server-Sent Events that announce them."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.calls: dict[int, dict[str, Any]] = {}  # call index -> its item
        self.seq = 0

    def sse(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        shown = {**item, "content": []} if "content" in item else dict(item)
        return [
            self.sse("response.output_item.added", output_index=len(self.output) - 1, item=shown)
        ]

    def _done(self, item: dict[str, Any]) -> str:
        item["status"] = "completed"
        return self.sse(
            "response.output_item.done", output_index=self.output.index(item), item=item
        )

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}

    def _open(self, kind: str) -> list[str]:
        if self.open is not None and self.open["type"] == kind:
            return []
        lines = self.close(at_end=False)
        if kind == "reasoning":
            item = {
                "type": "reasoning",
                "id": "rs_" + uuid.uuid4().hex,
                "summary": [],
                "content": [_reasoning_part("")],
                "status": "in_progress",
            }
            lines += self._add(item)
        else:
            item = {
                "type": "message",
                "id": "msg_" + uuid.uuid4().hex,
                "status": "in_progress",
                "role": "assistant",
                "content": [_text_part("")],
            }
            lines += self._add(item)
            lines.append(
                self.sse("response.content_part.added", **self._at(item), part=_text_part(""))
            )
        self.open = item
        return lines

    def apply(self, event: Event) -> list[str]:
        self.shape.parsed.add([event])
        if isinstance(event, Reasoning):
            lines = self._open("reasoning")
            assert self.open is not None
            self.open["content"][0]["text"] += event.text
            return [
                *lines,
                self.sse("response.reasoning_text.delta", **self._at(self.open), delta=event.text),
            ]
        if isinstance(event, Text):
            lines = self._open("message")
            assert self.open is not None
            self.open["content"][0]["text"] += event.text
            return [
                *lines,
                self.sse(
                    "response.output_text.delta",
                    **self._at(self.open),
                    delta=event.text,
                    logprobs=[],
                ),
            ]
        if isinstance(event, CallStart):
            lines = self.close(at_end=False)
            item = {
                "type": "function_call",
                "id": "fc_" + event.id.removeprefix("call_"),
                "call_id": event.id,
                "name": event.name,
                "arguments": "",
                "status": "in_progress",
            }
            self.calls[event.index] = item
            return lines + self._add(item)
        if isinstance(event, CallArgs):
            item = self.calls[event.index]
            item["arguments"] += event.text
            at = {"item_id": item["id"], "output_index": self.output.index(item)}
            return [self.sse("response.function_call_arguments.delta", **at, delta=event.text)]
        assert isinstance(event, CallDone)
        item = self.calls[event.index]
        item["arguments"] = event.call.arguments
        at = {"item_id": item["id"], "output_index": self.output.index(item)}
        return [
            self.sse(
                "response.function_call_arguments.done",
                **at,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._done(item),
        ]

    def close(self, at_end: bool = True) -> list[str]:
        """End the item being written. At the reply's end, a reply with nothing in it
        is one empty message."""
        item, self.open = self.open, None
        if item is None:
            if at_end and not self.output:
                return [*self._open("message"), *self.close()]
            return []
        text = item["content"][0]["text"]
        at = self._at(item)
        if item["type"] == "reasoning":
            lines = [self.sse("response.reasoning_text.done", **at, text=text)]
        else:
            lines = [
                self.sse("response.output_text.done", **at, text=text, logprobs=[]),
                self.sse("response.content_part.done", **at, part=_text_part(text)),
            ]
        return [*lines, self._done(item)]


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
