"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request's `input` (a string, or message and function-call items) and `instructions`
become a message list for the chat template; its reply comes back as output items (a
message of output_text, function calls), as one response object or as Server-Sent Events
(response.created ... response.completed). Every field is honoured, ignored for a stated
reason or refused (app.server.api_fields).

A stored response (`store`, the default) is what Parley does best: its conversation keeps
its K/V pinned, so a follow-up by `previous_response_id` continues that conversation and
computes only its new input (usage.input_tokens_details.cached_tokens says how much was
reused). Responses are kept in this process's memory, at most MAX_STORED of them (the
oldest go first), each in its tenant's namespace: another tenant gets a 404 as if it did
not exist. Without API keys, knowing a response's id is what entitles a client to it.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.chat.formats import ChatFormat
from app.chat.prompt import Message
from app.chat.tools import ToolCall, supports_tools
from app.server.api_fields import RESPONSES_FIELDS
from app.server.api_turn import (
    Generation,
    Produced,
    check_model,
    endpoint,
    read_json,
    reasoning_args,
)
from app.server.chat_service import ChatService
from app.server.errors import APIError
from app.server.openai_api import _until_disconnected
from app.server.openai_request import ToolUse, bad, request_params, tool_use
from app.server.protocol import MAX_MESSAGES
from app.server.responses_output import ResponseShape
from app.server.security import Principal

MAX_STORED = 10_000  # responses kept for GET / previous_response_id, per process


@dataclass
class StoredResponse:
    """A stored response: its object, and the history a follow-up goes on from."""

    id: str
    tenant: str
    owner: str
    conversation_id: str  # in the ChatService's store: the pinned K/V
    history: list[Message]  # its input history and its output (instructions excluded)
    body: dict[str, Any]
    input_items: list[dict[str, Any]]  # this request's input, as items with ids


class ResponseStore:
    """Stored responses by (tenant, id), oldest first. A conversation is let go (its K/V
    unpinned) when no stored response of its chain is left."""

    def __init__(self, chat: ChatService, max_stored: int = MAX_STORED) -> None:
        self.chat = chat
        self.max_stored = max_stored
        self._by_key: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._chains: dict[tuple[str, str], int] = {}  # (tenant, conversation) -> responses

    def find(self, principal: Principal, response_id: str) -> StoredResponse:
        """Raises APIError(404) unless `principal` owns a stored response of that id."""
        stored = self._by_key.get((principal.tenant, response_id))
        # Without keys an API client is nobody in particular (it keeps no cookie): the
        # response's id, 128 random bits, is what entitles a request to it.
        if stored is None or (principal.tenant and stored.owner != principal.owner):
            raise APIError(
                404,
                f"no response {response_id!r} is stored here (not stored, "
                "deleted, or let go as the store filled)",
                param="response_id",
                code="not_found",
            )
        return stored

    def put(self, stored: StoredResponse) -> None:
        key = (stored.tenant, stored.id)
        chain = (stored.tenant, stored.conversation_id)
        self._by_key[key] = stored
        self._chains[chain] = self._chains.get(chain, 0) + 1
        while len(self._by_key) > self.max_stored:
            self._drop(next(iter(self._by_key)))

    def delete(self, stored: StoredResponse) -> None:
        self._drop((stored.tenant, stored.id))

    def _drop(self, key: tuple[str, str]) -> None:
        stored = self._by_key.pop(key, None)
        if stored is None:
            return
        chain = (stored.tenant, stored.conversation_id)
        left = self._chains.pop(chain, 1) - 1
        if left > 0:
            self._chains[chain] = left
            return
        conv = self.chat.store.find(*chain)
        if conv is not None and conv.turn is None:
            self.chat.store.delete(conv)  # frees its pinned K/V


class ResponsesAPI:
    """The handlers, over the app's ChatService."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat
        self.model_name = chat.engine.info.name
        self.max_tokens_limit = chat.max_tokens_limit
        self.template_has_tools = supports_tools(chat.prompt.tokenizer)
        self.format = ChatFormat.of(chat.prompt.tokenizer)
        self.store = ResponseStore(chat)

    async def create(self, request: Request) -> Response:
        body = await read_json(request, RESPONSES_FIELDS)
        check_model(body, self.model_name)
        principal: Principal = request.user
        previous = None
        if body.get("previous_response_id") is not None:
            if not isinstance(body["previous_response_id"], str):
                raise bad("previous_response_id must be a string", "previous_response_id")
            previous = self.store.find(principal, body["previous_response_id"])
        store = body.get("store", True)
        if not isinstance(store, bool):
            raise bad("store must be a boolean", "store")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad("instructions must be a string", "instructions")
        history = [*(previous.history if previous else []), *input_messages(body.get("input"))]
        if len(history) > MAX_MESSAGES:
            raise bad(f"at most {MAX_MESSAGES} messages, the previous responses' included", "input")
        messages = [Message("system", instructions)] if instructions else []
        messages += history
        chat_body = _as_chat(body)
        tools = tool_use(chat_body, self.template_has_tools)
        params = _params(chat_body, self.max_tokens_limit, tools)
        for name in ("user", "prompt_cache_key"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise bad(f"{name} must be a string", name)
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise bad("metadata must be an object", "metadata")
        reasoning = body.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, dict):
            raise bad("reasoning must be an object", "reasoning")
        effort = (reasoning or {}).get("effort")
        template_args = reasoning_args(self.format, effort, "reasoning")
        thinking = effort not in ("none", "minimal")
        conv = None
        chain = previous.conversation_id if previous else "response:" + uuid.uuid4().hex
        if store:
            conv = self.chat.store.get(principal.tenant, chain, principal.owner)
        gen = Generation(
            self.chat,
            principal,
            messages,
            params,
            tools,
            conv,
            body.get("prompt_cache_key") or body.get("user"),
            "input",
            template_args,
            body.get("truncation") == "auto",
        )
        shape = ResponseShape(self, body, tools, previous.id if previous else None, thinking)

        def keep(done: Produced, response: dict[str, Any]) -> None:
            if store and not done.failed:
                reply = shape.parsed
                history_out = [*history, *_output_messages(reply.content, reply.calls)]
                self.store.put(
                    StoredResponse(
                        response["id"],
                        principal.tenant,
                        principal.owner,
                        chain,
                        history_out,
                        response,
                        input_items(body.get("input")),
                    )
                )

        async def respond() -> Response:
            await gen.begin()  # errors surface before any byte is sent
            if body.get("stream"):
                return StreamingResponse(shape.events(gen, keep), media_type="text/event-stream")
            done, response = await shape.whole(gen)
            keep(done, response)
            return JSONResponse(response)

        if body.get("truncation") not in (None, "disabled", "auto"):
            raise bad('truncation must be "disabled" (the default) or "auto"', "truncation")
        if not isinstance(body.get("stream", False), bool):
            raise bad("stream must be a boolean", "stream")
        return await _until_disconnected(request, respond(), gen)  # type: ignore[arg-type]

    async def one(self, request: Request) -> Response:
        stored = self.store.find(request.user, request.path_params["response_id"])
        if request.method == "DELETE":
            self.store.delete(stored)
            return JSONResponse({"id": stored.id, "object": "response.deleted", "deleted": True})
        if request.url.path.endswith("/input_items"):
            return JSONResponse(_page(stored.input_items, request.query_params))
        if request.query_params.get("stream") not in (None, "false"):
            raise bad("a stored response is not streamed again: GET it without stream", "stream")
        return JSONResponse(stored.body)


# -- requests ------------------------------------------------------------------------------


def input_items(value: Any) -> list[dict[str, Any]]:
    """A request's (valid) `input` as the items /input_items lists, each with an id."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = []
    for item in value or []:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                content = [{"type": part, "text": content}]
            out = {
                "type": "message",
                "id": item.get("id") or "msg_" + uuid.uuid4().hex,
                "role": item["role"],
                "status": "completed",
                "content": content,
            }
        else:
            prefix = "fc_" if kind == "function_call" else "fco_"
            out = {**item, "id": item.get("id") or prefix + uuid.uuid4().hex, "status": "completed"}
        items.append(out)
    return items


def _page(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """One page of a list, as OpenAI's list endpoints answer: `order` (desc by
    default), `limit` (1-100, 20 by default), `after` an item id."""
    order, limit, after = query.get("order", "desc"), query.get("limit", "20"), query.get("after")
    if order not in ("asc", "desc"):
        raise bad("order must be asc or desc", "order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise bad("limit must be an integer in [1, 100]", "limit")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [i["id"] for i in ordered]
        if after not in ids:
            raise bad(f"after names no item of this response: {after!r}", "after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[: int(limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > len(page),
    }


def input_messages(value: Any) -> list[Message]:
    """`input` -> messages: a string is one user message; items are messages, function
    calls (an assistant's tool_calls) and their outputs (tool messages)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [Message("user", value)]
    if not isinstance(value, list):
        raise bad("input must be a string or a list of items", "input")
    out: list[Message] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role == "developer":
                role = "system"
            if role not in ("system", "user", "assistant"):
                raise bad(f"input[{i}].role must be system, developer, user or assistant", "input")
            out.append(Message(role, _text(item.get("content"), i)))
        elif kind == "function_call":
            call = _function_call(item, i)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                out[-1] = Message("assistant", last.content, (*last.tool_calls, call))
            else:
                out.append(Message("assistant", "", (call,)))
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(output, str) or not isinstance(call_id, str):
                raise bad(
                    f"input[{i}]: a function_call_output has a call_id and an output string",
                    "input",
                )
            out.append(Message("tool", output, tool_call_id=call_id))
        else:
            raise bad(
                f"input[{i}].type {kind!r} is not supported: message, function_call "
                "and function_call_output are",
                "input",
            )
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"input[{i}].content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise bad(
                f"input[{i}].content: only text parts (input_text, output_text) are supported",
                "input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _function_call(item: dict[str, Any], i: int) -> dict[str, Any]:
    name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not all(isinstance(v, str) for v in (name, args, call_id)):
        raise bad(f"input[{i}]: a function_call has call_id, name and arguments strings", "input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The Responses fields in /v1/chat/completions' shape, for its parsers."""
    chat: dict[str, Any] = {
        k: body.get(k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stream")
    }
    chat["max_tokens"] = body.get("max_output_tokens")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools must be a list", "tools")
        converted = []
        for tool in tools:
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise bad(f"only function tools are supported, not {kind!r}", "tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            converted.append({"type": "function", "function": fn})
        chat["tools"] = converted
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad(
                "tool_choice must be none, auto, required or {type: function, name}", "tool_choice"
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat["tool_choice"] = choice
    chat["parallel_tool_calls"] = body.get("parallel_tool_calls")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise bad("text must be an object", "text")
        if text.get("verbosity") not in (None, "medium"):
            raise bad("text.verbosity is not supported: medium only", "text")
        fmt = text.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
        chat["response_format"] = fmt
    return chat


def _params(chat: dict[str, Any], limit: int, tools: ToolUse | None):
    """SamplingParams, errors naming the Responses API's fields."""
    names = {"max_tokens": "max_output_tokens", "response_format": "text"}
    try:
        return request_params(chat, limit, chat=True, tools=tools)
    except APIError as err:
        if err.param in names:
            err.message = err.message.replace(err.param, names[err.param])
            err.param = names[err.param]
        raise


def _output_messages(text: str, calls: list[ToolCall]) -> list[Message]:
    if calls:
        return [Message("assistant", text, tuple(c.to_dict() for c in calls))]
    return [Message("assistant", text)]


# -- responses -----------------------------------------------------------------------------


def routes() -> list[Route]:
    def api(request: Request) -> ResponsesAPI:
        return request.state.responses

    return [
        endpoint(api, ResponsesAPI.create, path="/v1/responses"),
        endpoint(
            api, ResponsesAPI.one, path="/v1/responses/{response_id}", methods=("GET", "DELETE")
        ),
        endpoint(
            api, ResponsesAPI.one, path="/v1/responses/{response_id}/input_items", methods=("GET",)
        ),
    ]
