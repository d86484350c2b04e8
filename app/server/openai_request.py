"""OpenAI request bodies -> what the engine and the prompt builder take: SamplingParams
(through the shared parser, app.server.params, with OpenAI's spellings), the chat
messages, the tools. Every error is an APIError(400) naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.chat.prompt import Message
from app.chat.tools import forced_call_schema
from app.engine.errors import BadParameter
from app.engine.request import ResponseFormat, SamplingParams
from app.server.errors import APIError
from app.server.params import PARAMS, sampling_params
from app.server.protocol import MAX_MESSAGES

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
# Entries (a token, or one of its top alternatives) that a response built in memory may
# hold: ~80 bytes of JSON each, so ~40 MB. n=64 x 8191 tokens without logprobs fits; with
# 20 alternatives a token the same request would be ~0.8 GiB. Streamed, no cap applies.
MAX_RESPONSE_ENTRIES = 1 << 19


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asked of tools: the definitions to render, and whether the
    reply is free to call them ("auto"), must be one call ("forced"), or calls none."""

    tools: list[dict[str, Any]]
    mode: str  # "auto" or "forced"
    parallel: bool = True


def request_params(
    body: dict[str, Any], max_tokens_limit: int, chat: bool, tools: ToolUse | None = None
) -> SamplingParams:
    """SamplingParams from an OpenAI request body. Raises APIError(400) naming the field."""
    values = {key: body.get(key) for key in PARAMS}
    param = "max_tokens"
    if body.get("max_completion_tokens") is not None:
        values["max_tokens"] = body["max_completion_tokens"]
        param = "max_completion_tokens"
    extra: dict[str, Any] = {}
    n = body.get("n")
    if n is not None:
        extra["n"] = n
    if not chat and body.get("best_of") not in (None, 1, n):
        raise bad("best_of must equal n: returning the best of more choices is not supported",
                  "best_of")  # fmt: skip
    if chat:
        extra.update(_chat_logprobs(body))
    else:
        extra.update(_completion_logprobs(body))
    if body.get("logit_bias") is not None:
        extra["logit_bias"] = _logit_bias(body["logit_bias"])
    fmt = response_format(body.get("response_format"))
    if tools is not None and tools.mode == "forced":
        choice = body.get("tool_choice")
        name = choice["function"]["name"] if isinstance(choice, dict) else None
        fmt = ResponseFormat("json_schema", json.dumps(forced_call_schema(tools.tools, name)))
    if fmt is not None:
        extra["response_format"] = fmt
    try:
        params = sampling_params(values, max_tokens_limit, extra)
    except BadParameter as exc:
        name = param if exc.name == "max_tokens" else exc.name
        message = str(exc).replace("max_tokens", name, 1) if name else str(exc)
        raise bad(message, name) from None
    if body.get("stream") is not True:
        check_response_size(params, max_tokens_limit, param)
    return params


def check_response_size(params: SamplingParams, max_tokens_limit: int, param: str) -> None:
    """Refuse a response to be built whole in memory that would hold more than
    MAX_RESPONSE_ENTRIES tokens and alternatives: n x max_tokens x (1 + top_logprobs)."""
    tokens = max_tokens_limit if params.max_tokens is None else params.max_tokens
    per_token = 1 + (params.logprobs or 0)
    entries = params.n * tokens * per_token
    if entries > MAX_RESPONSE_ENTRIES:
        raise bad(
            f"n x {param} x (1 + top_logprobs) = {params.n} x {tokens} x {per_token} = "
            f"{entries} entries, more than the {MAX_RESPONSE_ENTRIES} a response may hold: "
            f"lower n, {param} or top_logprobs, or set stream: true to read it as it comes",
            "n",
            "response_too_large",
        )


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("logprobs must be a boolean", "logprobs")
    if top is not None and not logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if not logprobs:
        return {}
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise bad("top_logprobs must be an integer", "top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise bad(f"top_logprobs must be in [0, 20], got {top}", "top_logprobs")
    return {"logprobs": top or 0}


def _completion_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    k, echo = body.get("logprobs"), body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad("echo must be a boolean", "echo")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise bad("logprobs must be an integer (the alternatives per token)", "logprobs")
    if k is not None and not 0 <= k <= MAX_COMPLETION_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {k}", "logprobs")
    out: dict[str, Any] = {} if k is None else {"logprobs": k}
    if echo and k is not None:
        out["prompt_logprobs"] = k
    elif echo and body.get("max_tokens") == 0:
        out["prompt_logprobs"] = 0  # the prompt back, nothing generated: a scoring pass
    return out


def _logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise bad("logit_bias must map token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad(f"logit_bias keys must be token ids, not {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("logit_bias values must be numbers", "logit_bias")
        out[token] = float(value)
    return out


def response_format(value: Any) -> ResponseFormat | None:
    """OpenAI's response_format -> ResponseFormat (None for plain text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise bad("response_format.json_schema.schema must be a JSON Schema object",
                      "response_format")  # fmt: skip
        # strict: false is followed strictly too: the mask is the only way we have.
        return ResponseFormat("json_schema", json.dumps(schema))
    raise bad("response_format.type must be text, json_object or json_schema", "response_format")


def tool_use(body: dict[str, Any], template_has_tools: bool) -> ToolUse | None:
    """The request's tools, or None when it has none or tool_choice is "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    if not template_has_tools:
        raise bad("this model's chat template has no tool support: 'tools' and "
                  "'tool_choice' cannot be served", "tools")  # fmt: skip
    if not isinstance(tools, list) or not all(_is_function(t) for t in tools):
        raise bad("tools must be a list of {type: function, function: {name, parameters}}",
                  "tools")  # fmt: skip
    if choice in (None, "auto"):
        mode = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        mode = "forced"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad(f"tool_choice names no tool in tools: {name!r}", "tool_choice")
        mode = "forced"
    else:
        raise bad("tool_choice must be none, auto, required or a function", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    return ToolUse(tools, mode, parallel is not False)


def _is_function(tool: Any) -> bool:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return (
        tool.get("type") == "function"
        and isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
        and isinstance(fn.get("parameters", {}), dict)
    )


def chat_messages(body: dict[str, Any], tools_allowed: bool) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad(f"at most {MAX_MESSAGES} messages", "messages")
    roles = ("system", "user", "assistant", "tool") if tools_allowed else ("system", "user",
                                                                          "assistant")  # fmt: skip
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system role
        if role not in roles:
            raise bad(f"messages[{i}].role must be {', '.join(roles)}", "messages")
        calls = m.get("tool_calls")
        if calls and not tools_allowed:
            raise bad(f"messages[{i}].tool_calls: this model's chat template has no tool "
                      "support", "messages")  # fmt: skip
        content = m.get("content")
        text = "" if content is None and (calls or role == "tool") else _content(content, i)
        out.append(Message(role, text, tuple(calls) if calls else None, m.get("tool_call_id")))
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
