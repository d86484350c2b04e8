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
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.chat.formats import ChatFormat
from app.chat.prompt import ChatPrompt
from app.chat.tools import supports_tools
from app.chat.window import HistoryTooLong, Window, fit, reply_room
from app.engine.engine_request import EngineRequest
from app.engine.outputs import RequestOutput
from app.engine.protocol import EngineClient
from app.engine.request import SamplingParams
from app.server import json_input
from app.server.chat_service import renders_inline
from app.server.errors import ENGINE_ERRORS, APIError, api_error
from app.server.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, check_fields
from app.server.openai_request import bad, chat_messages, request_params, tool_use
from app.server.openai_response import Responder, Shape, TokenTexts
from app.server.security import Principal

MAX_BODY_BYTES = 4 << 20
# With "truncation": "auto", how many messages of the history the model did not see.
TRUNCATED_HEADER = "x-parley-truncated-messages"
INLINE_PARSE_BYTES = 256 << 10  # larger bodies are parsed off the event loop (~10 ms a MiB)


# -- the API -------------------------------------------------------------------------------


class OpenAIAPI:
    """Handlers over the app's engine and chat prompt builder."""

    def __init__(self, engine: EngineClient, prompt: ChatPrompt, cache_salt) -> None:
        self.engine = engine
        self.prompt = prompt
        self.model_name = engine.info.name
        self.max_tokens_limit = engine.info.max_model_len - 1
        self.cache_salt = cache_salt  # Principal -> salt or None (tenant isolation)
        self.tokenizer = engine.info.tokenizer
        self.template_has_tools = supports_tools(self.tokenizer)
        self.format = ChatFormat.of(self.tokenizer)  # tool-call and reasoning formats
        self.texts = TokenTexts(self.tokenizer)

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
        body = await self._body(request, CHAT_FIELDS)
        tools = tool_use(body, self.template_has_tools)
        params = request_params(body, self.max_tokens_limit, chat=True, tools=tools)
        messages = chat_messages(body, self.template_has_tools)
        definitions = tools.tools if tools else None
        effort = body.get("reasoning_effort")
        try:
            template_args = self.format.template_args(effort)
        except ValueError as exc:
            raise bad(str(exc), "reasoning_effort") from None
        truncation = body.get("truncation")
        if truncation not in (None, "disabled", "auto"):
            raise bad('truncation must be "disabled" (the default) or "auto"', "truncation")

        def build() -> Window:
            # OpenAI's default: a history too long for the window is an error, which the
            # engine raises; "auto" drops the oldest turns after the system prompt.
            if truncation != "auto":
                ids = self.prompt.render(messages, None, definitions, template_args=template_args)
                return Window(messages, ids, 0, None)
            room = reply_room(params.max_tokens, window)
            try:
                return fit(messages, lambda ms: self.prompt.render(ms, None, definitions,
                           template_args=template_args), window, room, truncate=True)  # fmt: skip
            except HistoryTooLong as exc:
                raise APIError(400, str(exc), param="messages",
                               code="context_length_exceeded") from None  # fmt: skip

        window = self.max_tokens_limit + 1
        if not renders_inline(messages):
            kept = await asyncio.to_thread(build)
        else:
            kept = build()
        shape = Shape(chat=True, n=params.n, logprobs=params.logprobs is not None, tools=tools,
                      format=self.format, thinking=effort not in ("none", "minimal"))  # fmt: skip
        response = await self._complete(request, body, kept.prompt_ids, params, shape)
        if kept.dropped:
            response.headers[TRUNCATED_HEADER] = str(kept.dropped)
        return response

    async def completions(self, request: Request) -> Response:
        body = await self._body(request, COMPLETION_FIELDS)
        params = request_params(body, self.max_tokens_limit, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids: str | list[int] = prompt  # token ids
        elif isinstance(prompt, str) and prompt:
            prompt_ids = prompt
        else:
            raise bad("'prompt' must be a non-empty string (one prompt per request)", "prompt")
        shape = Shape(chat=False, n=params.n, logprobs=params.logprobs is not None)
        if body.get("echo"):
            if isinstance(prompt_ids, str):
                prompt_ids = self.tokenizer.encode(prompt_ids, add_special_tokens=False)
            shape.prompt_ids = list(prompt_ids)
            shape.echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
            if params.max_tokens == 0 and params.n > 1:
                # Nothing is sampled: the n choices are one scoring pass, repeated.
                shape.replicas, params = params.n, replace(params, n=1)
        return await self._complete(request, body, prompt_ids, params, shape)

    async def _body(self, request: Request, fields) -> dict[str, Any]:
        raw = await _read_body(request)
        try:
            if len(raw) > INLINE_PARSE_BYTES:
                body = await asyncio.to_thread(json_input.loads, raw)
            else:
                body = json_input.loads(raw)
        except json_input.BadJSON as exc:
            raise bad(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        check_fields(body, fields)
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
        self, request: Request, body: dict, prompt, params: SamplingParams, shape: Shape
    ) -> Response:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("'stream' must be a boolean", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        hint = body.get("prompt_cache_key") or body.get("user")  # where its K/V is
        for name in ("prompt_cache_key", "user"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise bad(f"'{name}' must be a string", name)
        asked = EngineRequest(
            prompt,
            params,
            "api-" + uuid.uuid4().hex,
            cache_salt=self.cache_salt(request.user),
            routing_key=f"user:{hint}" if hint else None,  # several replicas: its K/V's home
        )
        outputs = self.engine.generate(asked)
        chat = shape.chat
        meta = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": self.model_name,
        }
        responder = Responder(meta, shape, self.texts)
        prompt_param = "messages" if chat else "prompt"

        async def respond() -> Response:
            try:
                first = await outputs.__anext__()  # errors surface before any byte is sent
            except ENGINE_ERRORS as exc:
                raise api_error(exc, prompt_param) from None
            if stream:
                include_usage = bool(options.get("include_usage"))
                events = responder.events(first, outputs, include_usage)
                return StreamingResponse(events, media_type="text/event-stream")
            return await responder.collect(first, outputs)

        # From acceptance on, a client that leaves aborts its request: while it queues,
        # while its prompt is computed, and (non-streaming) until the whole reply is ready.
        # A streaming response, once started, stops at its next send to a closed socket.
        return await _until_disconnected(request, respond(), outputs)


async def _read_body(request: Request) -> bytes:
    """The body, up to MAX_BODY_BYTES: refused by its declared length before a byte is
    read, and otherwise as soon as more came in (a client may send gigabytes, chunked)."""
    too_large = APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


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
