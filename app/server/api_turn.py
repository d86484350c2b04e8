"""One reply to a message list, for the /v1 surfaces that speak in messages and items
(the Responses API, Anthropic's Messages): the prompt through the chat template, the
engine stream, what it produced, and (for a stored conversation) its pinned K/V.

It goes through the same seams as /v1/chat/completions: the ChatService's prompt and
conversations, the engine's `generate`, the error mapping of app.server.errors. A
conversation given here keeps the reply's K/V pinned for its next turn, and the reply's
own token ids for splicing into the next prompt (app.chat.prompt), so a follow-up costs
only its new tokens.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jinja2
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.chat.formats import ChatFormat, Parsed, ReplyStream
from app.chat.prompt import Message
from app.chat.sessions import Conversation
from app.chat.window import HistoryTooLong, fit, reply_room
from app.engine.engine_request import EngineRequest
from app.engine.outputs import RequestOutput
from app.engine.request import FinishReason, SamplingParams
from app.server import json_input
from app.server.chat_service import ChatService, renders_inline
from app.server.errors import ENGINE_ERRORS, APIError, api_error
from app.server.openai_api import INLINE_PARSE_BYTES, _read_body
from app.server.openai_fields import Field, check_fields
from app.server.openai_request import ToolUse, bad
from app.server.security import Principal


async def read_json(request: Request, fields: dict[str, Field]) -> dict[str, Any]:
    """The request's JSON object, every field checked against `fields`. Raises APIError."""
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
    return body


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


class APISurface(Protocol):
    """What a reply's output shape reads of the API that made it (ResponsesAPI,
    MessagesAPI): named here, so that the shapes need not import their APIs back."""

    chat: ChatService
    model_name: str
    format: ChatFormat


@dataclass
class Produced:
    """What a reply has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    last: RequestOutput | None = None

    @property
    def failed(self) -> bool:
        return self.last is not None and self.last.finish_reason is FinishReason.ERROR


class Generation:
    """One reply: `begin()` renders the prompt and starts the request (errors surface
    there, before a byte is sent); `outputs()` streams it; `close()` ends it (always)."""

    def __init__(
        self,
        chat: ChatService,
        principal: Principal,
        messages: list[Message],
        params: SamplingParams,
        tools: ToolUse | None = None,
        conversation: Conversation | None = None,
        routing_hint: str | None = None,
        prompt_param: str = "messages",
        template_args: dict[str, Any] | None = None,
        truncate: bool = False,
    ) -> None:
        self.chat = chat
        self.principal = principal
        self.messages = messages
        self.params = params
        self.tools = tools
        # A conversation with a turn in flight (a second follow-up of the same response
        # at once) is not pinned again: this reply runs on the prefix cache alone.
        self.conversation = conversation if conversation and conversation.turn is None else None
        self.routing_hint = routing_hint
        self.prompt_param = prompt_param
        self.template_args = template_args
        self.truncate = truncate  # drop the oldest turns where the window is full
        self.request_id = "api-" + uuid.uuid4().hex
        self.token = uuid.uuid4().hex
        self.produced = Produced()
        self._stream: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None

    async def begin(self) -> RequestOutput:
        conv = self.conversation
        if conv is not None:
            conv.turn = self.token
        try:
            limit = (self.params.max_tokens or 0) if self.truncate else None
            ids = await render(
                self.chat, self.messages, self.tools, conv, self.template_args, limit
            )
            routing = self.routing_hint or (conv.key if conv else None)
            asked = EngineRequest(
                ids,
                self.params,
                self.request_id,
                conv.key if conv else None,
                cache_salt=self.chat.cache_salt(self.principal),
                routing_key=f"user:{routing}" if routing else None,
            )
            self._stream = self.chat.engine.generate(asked)
            self._first = await self._stream.__anext__()
        except ENGINE_ERRORS as exc:
            self.close()
            raise api_error(exc, self.prompt_param) from None
        except BaseException:
            self.close()
            raise
        return self._first

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every output, the first included; the conversation remembers a finished reply."""
        assert self._stream is not None and self._first is not None, "begin() first"
        try:
            self._add(self._first)
            yield self._first
            async for out in self._stream:  # leaving early (client gone) aborts it
                self._add(out)
                yield out
            self._remember()
        finally:
            self.close()

    async def collect(self) -> Produced:
        async for _ in self.outputs():
            pass
        return self.produced

    def _add(self, out: RequestOutput) -> None:
        self.produced.text += out.new_text
        self.produced.token_ids += out.new_token_ids
        self.produced.last = out

    def _remember(self) -> None:
        """The conversation grows by the reply, and keeps the reply's ids where they
        decode to exactly its text (as ChatService.end_turn does for /ws turns)."""
        conv, done = self.conversation, self.produced
        if conv is None or done.last is None or not done.last.finished:
            return
        if done.last.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        conv.messages = [*self.messages, Message("assistant", done.text)]
        ids = list(done.token_ids)
        if ids and ids[-1] in self.chat.eos_token_ids:
            ids.pop()  # the template writes the end of turn itself
        if self.chat.prompt.tokenizer.decode(ids, skip_special_tokens=True) == done.text:
            conv.remember_reply(done.text, ids)

    def close(self) -> None:
        conv = self.conversation
        if conv is not None and conv.turn == self.token:
            conv.turn = None

    async def aclose(self) -> None:
        """The client went away: abort the request (openai_api._until_disconnected)."""
        if self._stream is not None:
            await self._stream.aclose()
        self.close()


async def render(
    chat: ChatService,
    messages: list[Message],
    tools: ToolUse | None,
    conversation: Conversation | None = None,
    template_args: dict[str, Any] | None = None,
    truncate_for: int | None = None,
) -> list[int]:
    """The prompt's token ids (large histories off the event loop). With `truncate_for`
    (the reply's max_tokens, 0 for none), the oldest turns after the system prompt give way
    where the history outgrows the window (app.chat.window). A template that refuses the
    history (roles out of order, say) is the client's error: APIError(400)."""
    replies = conversation.replies if conversation is not None else None
    definitions = tools.tools if tools else None

    def render_some(some: list[Message]) -> list[int]:
        return chat.prompt.render(some, replies, definitions, template_args=template_args)

    def run() -> list[int]:
        if truncate_for is None:
            return render_some(messages)
        window = chat.max_model_len
        room = reply_room(truncate_for or None, window)
        try:
            return fit(messages, render_some, window, room, truncate=True).prompt_ids
        except HistoryTooLong as exc:
            raise APIError(400, str(exc), param="input", code="context_length_exceeded") from None

    try:
        return run() if renders_inline(messages) else await asyncio.to_thread(run)
    except jinja2.TemplateError as exc:
        raise bad(f"the chat template refused these messages: {exc}", "messages") from None


def template_text(
    chat: ChatService,
    messages: list[Message],
    tools: ToolUse | None,
    generation_prompt: bool = True,
) -> str:
    """The chat template's text for `messages` (what /apply-template shows)."""
    extra = {"tools": list(tools.tools)} if tools else {}
    try:
        return chat.prompt.tokenizer.apply_chat_template(
            [m.to_dict() for m in messages],
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **extra,
        )
    except jinja2.TemplateError as exc:
        raise bad(f"the chat template refused these messages: {exc}", "messages") from None


def reply_stream(fmt: ChatFormat, tools: ToolUse | None, thinking: bool = True) -> ReplyStream:
    """The parser of one reply: its tool calls in the model's format (one JSON call when
    tool_choice forces it), its reasoning apart."""
    mode = tools.mode if tools else None
    return fmt.stream(mode, tools.parallel if tools else True, thinking)


def parse_reply(fmt: ChatFormat, text: str, tools: ToolUse | None, thinking: bool = True) -> Parsed:
    stream = reply_stream(fmt, tools, thinking)
    return Parsed().add(stream.feed(text) + stream.finish())


def reasoning_args(fmt: ChatFormat, effort: Any, param: str) -> dict[str, Any]:
    """The template's arguments for a reasoning effort; APIError(400) where the model's
    template offers no control over its reasoning."""
    if effort is not None and not isinstance(effort, str):
        raise bad(f"{param} must be a string", param)
    try:
        return fmt.template_args(effort)
    except ValueError as exc:
        raise bad(str(exc), param) from None


def matched_stop(chat: ChatService, done: Produced, stops: Sequence[str]) -> str | None:
    """Which stop string ended the reply, if one did: the text the reply's ids decode to
    goes on with it where the reply was cut."""
    last = done.last
    if not stops or last is None or last.finish_reason is not FinishReason.STOP:
        return None
    if done.token_ids and done.token_ids[-1] in chat.eos_token_ids:
        return None
    full = chat.prompt.tokenizer.decode(done.token_ids, skip_special_tokens=True)
    rest = full[len(done.text) :] if full.startswith(done.text) else full
    for stop in sorted(stops, key=len, reverse=True):
        if rest.startswith(stop):
            return stop
    return next((s for s in stops if s in rest), None)


def endpoint(
    api_of: Callable[[Request], Any],
    handler: Callable[[Any, Request], Any],
    error: Callable[[APIError], Response] = APIError.response,
    path: str = "",
    methods: tuple[str, ...] = ("POST",),
) -> Route:
    """A route to `handler(api, request)`, for a principal only; an APIError becomes
    `error(err)` (the surface's own error shape)."""

    async def run(request: Request) -> Response:
        if not isinstance(request.user, Principal):
            return error(
                APIError(
                    401,
                    "a valid API key is required: Authorization: Bearer "
                    "<key> (or x-api-key: <key>)",
                    "authentication_error",
                    code="invalid_api_key",
                )
            )
        try:
            return await handler(api_of(request), request)
        except APIError as err:
            return error(err)

    return Route(path, run, methods=list(methods))
