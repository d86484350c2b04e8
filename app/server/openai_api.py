"""The OpenAI-compatible API: /v1/models, /v1/chat/completions, /v1/completions.

Streaming answers are Server-Sent Events of `chat.completion.chunk` (or `text_completion`)
objects: the role first, then content deltas, `finish_reason` on the last choice chunk, the
usage in a chunk of its own when `stream_options.include_usage` is set, and `data: [DONE]`.
A client that goes away aborts its request. Errors are OpenAI error objects with the usual
status: 400 bad parameters or a context too long, 404 an unknown model, 429 overloaded,
503 no engine.

These requests have no session: a client that resends a growing message list (as OpenAI
clients do) gets its history from the prefix cache, block by block.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.chat.prompt import ChatPrompt, Message
from app.engine.errors import BadParameter
from app.engine.outputs import RequestOutput
from app.engine.protocol import EngineClient
from app.engine.request import FinishReason, SamplingParams
from app.server.errors import ENGINE_ERRORS, APIError, api_error
from app.server.params import PARAMS, sampling_params
from app.server.security import Principal

MAX_BODY_BYTES = 4 << 20
INLINE_RENDER_CHARS = 8192  # longer chats are rendered and tokenized off the event loop


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# -- request parsing -----------------------------------------------------------------------


def request_params(body: dict[str, Any], max_tokens_limit: int) -> SamplingParams:
    """SamplingParams from an OpenAI request body (the shared parser, with OpenAI's
    spellings). Raises APIError(400) naming the field."""
    values = {key: body.get(key) for key in PARAMS}
    param = "max_tokens"
    if body.get("max_completion_tokens") is not None:
        values["max_tokens"] = body["max_completion_tokens"]
        param = "max_completion_tokens"
    n = body.get("n", 1)
    if n != 1:
        raise bad("only n=1 is supported", "n")
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo"):
        raise bad("logprobs and echo are not supported", "logprobs")
    try:
        return sampling_params(values, max_tokens_limit)
    except BadParameter as exc:
        name = param if exc.name == "max_tokens" else exc.name
        message = str(exc).replace("max_tokens", name, 1) if name else str(exc)
        raise bad(message, name) from None


def chat_messages(body: dict[str, Any]) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system role
        if role not in ("system", "user", "assistant"):
            raise bad(f"messages[{i}].role must be system, user or assistant", "messages")
        out.append(Message(role, _content(m.get("content"), i)))
    return out


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[].text must be a string", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


# -- the API -------------------------------------------------------------------------------


class OpenAIAPI:
    """Handlers over the app's engine and chat prompt builder."""

    def __init__(self, engine: EngineClient, prompt: ChatPrompt, cache_salt) -> None:
        self.engine = engine
        self.prompt = prompt
        self.model_name = engine.info.name
        self.max_tokens_limit = engine.info.max_model_len - 1
        self.cache_salt = cache_salt  # Principal -> salt or None (tenant isolation)

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": self.model_name, "object": "model", "created": 0, "owned_by": "parley"}
                ],
            }
        )

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request)
        params = request_params(body, self.max_tokens_limit)
        messages = chat_messages(body)
        if sum(len(m.content) for m in messages) > INLINE_RENDER_CHARS:
            prompt_ids = await asyncio.to_thread(self.prompt.render, messages)
        else:
            prompt_ids = self.prompt.render(messages)
        return await self._complete(request, body, prompt_ids, params, chat=True)

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        params = request_params(body, self.max_tokens_limit)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids: str | list[int] = prompt  # token ids
        elif isinstance(prompt, str) and prompt:
            prompt_ids = prompt
        else:
            raise bad("'prompt' must be a non-empty string (one prompt per request)", "prompt")
        return await self._complete(request, body, prompt_ids, params, chat=False)

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise bad("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return body

    async def _complete(
        self, request: Request, body: dict, prompt, params: SamplingParams, chat: bool
    ) -> Response:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("'stream' must be a boolean", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        outputs = self.engine.generate(
            prompt,
            params,
            "api-" + uuid.uuid4().hex,
            cache_salt=self.cache_salt(request.user),
        )
        kind = "chat.completion" if chat else "text_completion"
        meta = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": self.model_name,
        }
        prompt_param = "messages" if chat else "prompt"

        async def respond() -> Response:
            try:
                first = await outputs.__anext__()  # errors surface before any byte is sent
            except ENGINE_ERRORS as exc:
                raise api_error(exc, prompt_param) from None
            if stream:
                include_usage = bool(options.get("include_usage"))
                events = _sse(meta, kind, first, outputs, chat, include_usage)
                return StreamingResponse(events, media_type="text/event-stream")
            return await _collect(meta, kind, first, outputs, chat)

        # From acceptance on, a client that leaves aborts its request: while it queues,
        # while its prompt is computed, and (non-streaming) until the whole reply is ready.
        # A streaming response, once started, stops at its next send to a closed socket.
        return await _until_disconnected(request, respond(), outputs)


def routes() -> list[Route]:
    """The /v1 routes; each finds the app's OpenAIAPI in the lifespan state."""

    def endpoint(handler):
        async def run(request: Request) -> Response:
            if not isinstance(request.user, Principal):
                return APIError(
                    401,
                    "a valid API key is required: Authorization: Bearer <key>",
                    code="invalid_api_key",
                ).response()
            try:
                return await handler(request.state.openai, request)
            except APIError as err:
                return err.response()

        return run

    return [
        Route("/v1/models", endpoint(OpenAIAPI.models), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(OpenAIAPI.chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(OpenAIAPI.completions), methods=["POST"]),
    ]


def _finish_reason(out: RequestOutput) -> str | None:
    if out.finish_reason is None:
        return None
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(
        out.finish_reason, str(out.finish_reason)
    )


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": out.cached_tokens,
            "tier_cached_tokens": out.tier_cached_tokens,  # Parley's: of those, from the tier
        },
    }


async def _collect(meta, kind, first, outputs, chat: bool) -> Response:
    text, last = first.new_text, first
    async for out in outputs:
        text += out.new_text
        last = out
    if last.finish_reason is FinishReason.ERROR:
        return APIError(500, "the engine failed this request", "server_error").response()
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(last)}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
        choice["logprobs"] = None
    return JSONResponse({**meta, "object": kind, "choices": [choice], "usage": _usage(last)})


async def _until_disconnected(
    request: Request, work: Awaitable[Response], outputs: AsyncIterator[RequestOutput]
) -> Response:
    """Run `work` unless the client goes away first: then cancel it, close the engine
    stream (which aborts the request) and answer nobody."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await outputs.aclose()  # a stream never started is closed here: the abort is sent
    return Response(status_code=499)  # nobody is listening


async def _sse(meta, kind, first, outputs, chat: bool, include_usage: bool):
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        payload = {**meta, "object": chunk_kind, "choices": choices, **extra}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def choice(out: RequestOutput, text: str) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0, "finish_reason": None}
        if chat:
            c["delta"] = {"content": text} if text else {}
        else:
            c["text"] = text
            c["logprobs"] = None
        return c

    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield event([role])
    last = first
    if first.new_text:
        yield event([choice(first, first.new_text)])
    async for out in outputs:  # leaving early (client gone) closes this: the request aborts
        last = out
        if out.new_text:
            yield event([choice(out, out.new_text)])
    if last.finish_reason is FinishReason.ERROR:
        error = {"message": "the engine failed this request", "type": "server_error"}
        yield f"data: {json.dumps({'error': error})}\n\n"
    else:
        final = choice(last, "")
        final["finish_reason"] = _finish_reason(last)
        yield event([final])
        if include_usage:
            yield event([], usage=_usage(last))
    yield "data: [DONE]\n\n"
