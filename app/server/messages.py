"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

`system`, and `messages` of user and assistant turns whose content is a string or blocks
(text, tool_use, tool_result), become a message list for the chat template; the reply
comes back as content blocks (text, tool_use) with a `stop_reason`, as one message or as
Server-Sent Events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop). Every field is honoured, ignored for a stated reason or refused
(app.server.api_fields). Errors have Anthropic's shape: {"type": "error", "error": {...}}.

Requests have no session, as on /v1/chat/completions: a client that resends its growing
history gets it from the prefix cache, and `usage.cache_read_input_tokens` says how much
(`input_tokens` counts only the rest, as Anthropic's do). The key may come as
`x-api-key` (what Anthropic's clients send) or as a Bearer token.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.chat.formats import ChatFormat
from app.chat.prompt import Message
from app.chat.tools import supports_tools
from app.server.api_fields import COUNT_TOKENS_FIELDS, MESSAGES_FIELDS
from app.server.api_turn import (
    Generation,
    check_model,
    endpoint,
    read_json,
    reasoning_args,
    render,
)
from app.server.chat_service import ChatService
from app.server.errors import APIError
from app.server.messages_output import MessageShape
from app.server.openai_api import _until_disconnected
from app.server.openai_request import ToolUse, bad, request_params, tool_use
from app.server.protocol import MAX_MESSAGES

# OpenAI error types -> Anthropic's, by status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(err: APIError) -> Response:
    kind = _ERROR_TYPES.get(err.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": err.message}}
    return JSONResponse(body, status_code=err.status, headers=err.headers)


class MessagesAPI:
    """The handlers, over the app's ChatService."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat
        self.model_name = chat.engine.info.name
        self.max_tokens_limit = chat.max_tokens_limit
        self.template_has_tools = supports_tools(chat.prompt.tokenizer)
        self.format = ChatFormat.of(chat.prompt.tokenizer)

    def _request(self, body: dict[str, Any]) -> tuple[list[Message], ToolUse | None]:
        check_model(body, self.model_name)
        messages = [*system_messages(body.get("system")), *turns(body.get("messages"))]
        tools = tool_use(_as_chat_tools(body), self.template_has_tools)
        return messages, tools

    def _thinking(self, value: Any) -> tuple[dict[str, Any], bool]:
        """The template's arguments for `thinking`, and whether the reply may think."""
        if value is None:
            return {}, True
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad("thinking.type must be enabled, disabled or adaptive", "thinking")
        if kind == "disabled":
            if self.format.effort_control is None:
                return {}, True  # nothing to turn off: the model does not think aloud
            return reasoning_args(self.format, "none", "thinking"), False
        # budget_tokens cannot bound a template's thinking: it goes on or off, no more.
        return reasoning_args(self.format, "medium", "thinking"), True

    async def create(self, request: Request) -> Response:
        body = await read_json(request, MESSAGES_FIELDS)
        messages, tools = self._request(body)
        template_args, thinking = self._thinking(body.get("thinking"))
        if body.get("max_tokens") is None:
            raise bad("max_tokens is required", "max_tokens")
        stops = body.get("stop_sequences") or []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop_sequences must be a list of strings", "stop_sequences")
        chat_body = {k: body.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k")}
        chat_body.update(stream=body.get("stream"), stop=stops or None)
        chat_body.update(_as_chat_tools(body))
        try:
            params = request_params(chat_body, self.max_tokens_limit, chat=True, tools=tools)
        except APIError as err:
            if err.param == "stop":
                err.param, err.message = (
                    "stop_sequences",
                    err.message.replace("stop", "stop_sequences", 1),
                )
            raise
        if not isinstance(body.get("stream", False), bool):
            raise bad("stream must be a boolean", "stream")
        metadata = body.get("metadata") or {}
        hint = metadata.get("user_id") if isinstance(metadata, dict) else None
        if not isinstance(metadata, dict) or not isinstance(hint, str | None):
            raise bad("metadata must be an object; its user_id a string", "metadata")
        gen = Generation(
            self.chat,
            request.user,
            messages,
            params,
            tools,
            None,
            hint,
            template_args=template_args,
        )
        shape = MessageShape(self, tools, stops, thinking)

        async def respond() -> Response:
            first = await gen.begin()  # errors surface before any byte is sent
            if body.get("stream"):
                return StreamingResponse(
                    shape.events(gen, first.prompt_tokens, first.cached_tokens),
                    media_type="text/event-stream",
                )
            return JSONResponse(await shape.message(gen))

        return await _until_disconnected(request, respond(), gen)  # type: ignore[arg-type]

    async def count_tokens(self, request: Request) -> Response:
        body = await read_json(request, COUNT_TOKENS_FIELDS)
        messages, tools = self._request(body)
        template_args, _ = self._thinking(body.get("thinking"))
        ids = await render(self.chat, messages, tools, None, template_args)
        return JSONResponse({"input_tokens": len(ids)})


# -- requests ------------------------------------------------------------------------------


def system_messages(system: Any) -> list[Message]:
    if system is None:
        return []
    if isinstance(system, str):
        return [Message("system", system)] if system else []
    if isinstance(system, list):
        return [Message("system", "".join(_text_block(b, "system") for b in system))]
    raise bad("system must be a string or a list of text blocks", "system")


def _text_block(block: Any, where: str) -> str:
    if (
        not isinstance(block, dict)
        or block.get("type") != "text"
        or not isinstance(block.get("text"), str)
    ):
        raise bad(f"{where}: expected a text block {{type: text, text}}", where.split("[")[0])
    return block["text"]


def turns(messages: Any) -> list[Message]:
    """Anthropic's messages -> chat messages: tool_use blocks become the assistant's tool
    calls, tool_result blocks tool messages (before the user's text of the same turn)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad(f"at most {MAX_MESSAGES} messages", "messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role must be user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append(Message(m["role"], content))
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content must be a string or a list of blocks", "messages")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                texts.append(_text_block(block, at))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result" and m["role"] == "user":
                out.append(_tool_result(block, at))
            else:
                raise bad(
                    f"{at}: {kind!r} blocks are not supported here (text, an "
                    "assistant's tool_use, a user's tool_result are)",
                    "messages",
                )
        if texts or calls or not content:
            out.append(Message(m["role"], "".join(texts), tuple(calls) or None))
    return out


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise bad(f"{at}: a tool_use block has an id and a name", "messages")
    args = json.dumps(block.get("input") or {}, ensure_ascii=False)
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": args},
    }


def _tool_result(block: dict[str, Any], at: str) -> Message:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(b, at) for b in content)
    if not isinstance(content, str) or not isinstance(block.get("tool_use_id"), str):
        raise bad(f"{at}: a tool_result block has a tool_use_id and text content", "messages")
    return Message("tool", content, tool_call_id=block["tool_use_id"])


def _as_chat_tools(body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's tools and tool_choice in /v1/chat/completions' shape."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools must be a list", "tools")
        converted = []
        for tool in tools:
            if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise bad(f"only custom tools are supported, not {kind!r}", "tools")
            if not isinstance(tool.get("name"), str):
                raise bad("a tool has a name", "tools")
            fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
            if "description" in tool:
                fn["description"] = tool["description"]
            converted.append({"type": "function", "function": fn})
        out["tools"] = converted
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind or "")
        if kind == "tool":
            mapped = {"type": "function", "function": {"name": choice.get("name")}}
        if mapped is None:
            raise bad("tool_choice.type must be auto, any, tool or none", "tool_choice")
        out["tool_choice"] = mapped
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


# -- responses -----------------------------------------------------------------------------


def routes() -> list[Route]:
    def api(request: Request) -> MessagesAPI:
        return request.state.messages

    return [
        endpoint(api, MessagesAPI.create, anthropic_error, "/v1/messages"),
        endpoint(api, MessagesAPI.count_tokens, anthropic_error, "/v1/messages/count_tokens"),
    ]
