"""Engine outputs -> OpenAI response objects: n choices (each output says its `index`),
logprobs in the chat and the completions shapes, echo, tool calls, usage (the prompt
counted once, the choices' completions summed), as one JSON body or as Server-Sent Events.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse, Response

from app.chat.formats import (
    CallArgs,
    CallStart,
    ChatFormat,
    Parsed,
    Reasoning,
    ReplyStream,
    Text,
)
from app.chat.tools import ToolCall
from app.engine.logprobs import Logprob
from app.engine.outputs import RequestOutput
from app.engine.request import FinishReason
from app.server.errors import APIError
from app.server.openai_request import ToolUse


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) writes each byte of a token as one
    printable character: printable Latin-1 bytes as themselves, the rest as 256 + k, in
    byte order. This undoes it, so a token's exact bytes can be reported."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in table.values())
    table.update({chr(256 + k): b for k, b in enumerate(others)})
    return table


class TokenTexts:
    """Token ids -> their bytes and text, as OpenAI's logprobs report them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoder = _byte_decoder()
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._decoder for c in piece):
                cached = bytes(self._decoder[c] for c in piece)
            else:  # another tokenizer family: its decoded text is the best we have
                cached = self.tokenizer.decode([token_id]).encode()
            self._cache[token_id] = cached
        return cached

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


@dataclass
class Shape:
    """What the response must carry besides text: set from the request."""

    chat: bool
    n: int
    logprobs: bool
    tools: ToolUse | None = None
    echo: str | None = None  # completions: the prompt's text, to put first
    prompt_ids: list[int] = field(default_factory=list)  # with echo
    replicas: int = 1  # the one choice repeated (echo + max_tokens 0 with n > 1)
    format: ChatFormat | None = None  # chat: how the model writes calls and reasoning
    thinking: bool = True  # False: the request turned the model's reasoning off

    def reply_stream(self) -> ReplyStream | None:
        """A parser for one choice's reply, where it has calls or reasoning to find."""
        fmt = self.format
        if fmt is None or not self.chat or (self.tools is None and not fmt.reasoning):
            return None
        mode = self.tools.mode if self.tools else None
        return fmt.stream(mode, self.tools.parallel if self.tools else True, self.thinking)


@dataclass
class _Choice:
    index: int
    text: str = ""
    logprobs: list[Logprob | None] = field(default_factory=list)
    last: RequestOutput | None = None
    offset: int = 0  # completions: characters of text before the next token
    echoed: bool = False
    stream: ReplyStream | None = None  # chat with tools or reasoning: the reply's parser
    calls: int = 0  # tool calls begun


class Responder:
    """Builds one request's response from its outputs."""

    def __init__(self, meta: dict[str, Any], shape: Shape, texts: TokenTexts) -> None:
        self.meta = meta
        self.shape = shape
        self.texts = texts

    # -- logprobs ---------------------------------------------------------------------

    def _chat_entry(self, lp: Logprob) -> dict[str, Any]:
        def one(token_id: int, value: float) -> dict[str, Any]:
            return {
                "token": self.texts.text(token_id),
                "logprob": value,
                "bytes": list(self.texts.bytes(token_id)),
            }

        return {**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}

    def _completion_logprobs(
        self, c: _Choice, tokens: list[int], lps: list[Logprob | None]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}  # fmt: skip
        for token, lp in zip(tokens, lps, strict=True):
            text = self.texts.text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            top = None if lp is None else {self.texts.text(t): v for t, v in lp.top}
            out["top_logprobs"].append(top)
            out["text_offset"].append(c.offset)
            c.offset += len(text)
        return out

    def _prompt_part(self, c: _Choice, out: RequestOutput) -> tuple[str, dict | None]:
        """Completions with echo: the prompt's text and (when asked) its logprobs."""
        if self.shape.echo is None:
            return "", None
        if not self.shape.logprobs or out.prompt_logprobs is None:
            return self.shape.echo, None
        scored = out.prompt_logprobs
        ids = [lp.token_id if lp is not None else None for lp in scored]
        if ids and ids[0] is None:  # the first prompt token has no logprob
            ids[0] = self.shape.prompt_ids[0]
        return self.shape.echo, self._completion_logprobs(c, ids, list(scored))

    # -- whole responses --------------------------------------------------------------

    async def collect(
        self, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> Response:
        choices: dict[int, _Choice] = {}
        prompt_logprobs = None

        def add(out: RequestOutput) -> None:
            nonlocal prompt_logprobs
            c = choices.setdefault(out.index, _Choice(out.index))
            c.text += out.new_text
            if out.logprobs:
                c.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                prompt_logprobs = out
            c.last = out

        add(first)
        async for out in outputs:
            add(out)
        if any(c.last and c.last.finish_reason is FinishReason.ERROR for c in choices.values()):
            return APIError(500, "the engine failed this request", "server_error").response()
        body_choices = []
        for c in sorted(choices.values(), key=lambda c: c.index):
            for r in range(self.shape.replicas):
                body_choices.append(self._final_choice(c, prompt_logprobs, c.index + r))
        last = [c.last for c in choices.values() if c.last is not None]
        body = {**self.meta, "object": "chat.completion" if self.shape.chat else
                "text_completion", "choices": body_choices, "usage": usage(last,
                self.shape.replicas)}  # fmt: skip
        return JSONResponse(body)

    def _final_choice(self, c: _Choice, prompt_out: RequestOutput | None, index: int) -> dict:
        assert c.last is not None
        reason = finish_reason(c.last)
        if self.shape.chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            parsed = self._parse(c.text)
            if parsed is not None:
                content, found, reasoning = parsed
                message["content"] = content or None
                if reasoning:
                    message["reasoning_content"] = reasoning
                if found:
                    message["tool_calls"] = [t.to_dict() for t in found]
                    if reason == "stop":
                        reason = "tool_calls"
            logprobs = None
            if self.shape.logprobs:
                entries = [self._chat_entry(lp) for lp in c.logprobs if lp is not None]
                logprobs = {"content": entries, "refusal": None}
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": reason}  # fmt: skip
        c.offset = 0
        text, logprobs = "", None
        if prompt_out is not None or self.shape.echo is not None:
            text, logprobs = self._prompt_part(c, prompt_out or c.last)
        text += c.text
        if self.shape.logprobs:
            gen = self._completion_logprobs(c, [lp.token_id for lp in c.logprobs if lp],
                                            c.logprobs)  # fmt: skip
            logprobs = gen if logprobs is None else {k: logprobs[k] + gen[k] for k in gen}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _parse(self, text: str) -> tuple[str, list[ToolCall], str] | None:
        stream = self.shape.reply_stream()
        if stream is None:
            return None
        parsed = Parsed().add(stream.feed(text) + stream.finish())
        return parsed.content, parsed.calls, parsed.reasoning

    # -- streaming --------------------------------------------------------------------

    async def events(self, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                     include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
        chat = self.shape.chat
        kind = "chat.completion.chunk" if chat else "text_completion"
        choices: dict[int, _Choice] = {}

        def event(items: list[dict[str, Any]], **extra: Any) -> str:
            payload = {**self.meta, "object": kind, "choices": items, **extra}
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        if chat:
            for i in range(self.shape.n):
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])  # fmt: skip
        failed = False

        async def every() -> AsyncIterator[RequestOutput]:
            yield first
            async for out in outputs:  # leaving early (client gone) aborts the request
                yield out

        async for out in every():
            c = choices.get(out.index)
            if c is None:
                c = choices[out.index] = _Choice(out.index, stream=self.shape.reply_stream())
            if out.finish_reason is FinishReason.ERROR:
                failed = True
                break
            c.text += out.new_text
            c.last = out
            if not chat and self.shape.echo is not None and not c.echoed:
                text, lps = self._prompt_part(c, out)
                c.echoed = True
                yield event([{"index": out.index, "text": text, "logprobs": lps,
                              "finish_reason": None}])  # fmt: skip
            if c.stream is not None:
                for item in self._parsed_chunks(c, out):
                    yield event([item])
                continue
            item = self._chunk(c, out)
            if item is not None:
                yield event([item])
            if out.finished:
                yield event([self._end_chunk(out)])
        if failed:
            error = {"message": "the engine failed this request", "type": "server_error"}
            yield f"data: {json.dumps({'error': error})}\n\n"
        elif include_usage:
            last = [c.last for c in choices.values() if c.last is not None]
            yield event([], usage=usage(last))
        yield "data: [DONE]\n\n"

    def _chunk(self, c: _Choice, out: RequestOutput) -> dict[str, Any] | None:
        lps = out.logprobs if self.shape.logprobs else None
        if not out.new_text and not lps:
            return None
        if self.shape.chat:
            logprobs = None
            if lps:
                logprobs = {"content": [self._chat_entry(lp) for lp in lps], "refusal": None}
            delta = {"content": out.new_text} if out.new_text else {}
            return {"index": out.index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": None}  # fmt: skip
        logprobs = None
        if lps:
            logprobs = self._completion_logprobs(c, [lp.token_id for lp in lps], list(lps))
        return {"index": out.index, "text": out.new_text, "logprobs": logprobs,
                "finish_reason": None}  # fmt: skip

    def _parsed_chunks(self, c: _Choice, out: RequestOutput) -> list[dict[str, Any]]:
        """Chat with tools or reasoning: the reply's events as deltas (content,
        reasoning_content, a call's id and name, then its argument deltas)."""
        assert c.stream is not None
        events = c.stream.feed(out.new_text)
        if out.finished:
            events += c.stream.finish()
        deltas: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Text):
                deltas.append({"content": e.text})
            elif isinstance(e, Reasoning):
                deltas.append({"reasoning_content": e.text})
            elif isinstance(e, CallStart):
                c.calls += 1
                deltas.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                               "function": {"name": e.name, "arguments": ""}}]})  # fmt: skip
            elif isinstance(e, CallArgs):
                deltas.append({"tool_calls": [{"index": e.index,
                                               "function": {"arguments": e.text}}]})  # fmt: skip
        lps = out.logprobs if self.shape.logprobs else None
        logprobs = None
        if lps:
            logprobs = {"content": [self._chat_entry(lp) for lp in lps], "refusal": None}
            if not deltas:
                deltas.append({})
        items = [{"index": c.index, "delta": d, "logprobs": logprobs if i == 0 else None,
                  "finish_reason": None} for i, d in enumerate(deltas)]  # fmt: skip
        if out.finished:
            reason = finish_reason(out)
            if c.calls and reason == "stop":
                reason = "tool_calls"
            items.append({"index": c.index, "delta": {}, "logprobs": None,
                          "finish_reason": reason})  # fmt: skip
        return items

    def _end_chunk(self, out: RequestOutput) -> dict[str, Any]:
        if self.shape.chat:
            return {"index": out.index, "delta": {}, "logprobs": None,
                    "finish_reason": finish_reason(out)}  # fmt: skip
        return {"index": out.index, "text": "", "logprobs": None,
                "finish_reason": finish_reason(out)}  # fmt: skip


def finish_reason(out: RequestOutput) -> str | None:
    if out.finish_reason is None:
        return None
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(
        out.finish_reason, str(out.finish_reason)
    )


def usage(last: list[RequestOutput], replicas: int = 1) -> dict[str, Any]:
    """The prompt once (the choices share it), the choices' completions summed."""
    prompt = max((o.prompt_tokens for o in last), default=0)
    completion = sum(o.completion_tokens for o in last) * replicas
    first = [o for o in last if o.index == 0]
    cached = max((o.cached_tokens for o in first), default=0)
    tier_cached = max((o.tier_cached_tokens for o in first), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # tier_cached_tokens is Parley's: of the cached tokens, those loaded from the KV tier
        "prompt_tokens_details": {"cached_tokens": cached, "tier_cached_tokens": tier_cached},
    }
