"""Every field of a Responses API request and of an Anthropic Messages request, and what
Parley does with it: honoured, accepted and ignored for a stated reason, or refused with a
400 naming it, as app.server.openai_fields does for chat. A field in neither table (a typo,
a newer API's field) is refused too.

docs/api.md shows these tables (tests/server/test_api_fields.py keeps them in step).
"""

from __future__ import annotations

from typing import Any

from app.server.openai_fields import Field


def _honoured(note: str = "") -> Field:
    return Field("honoured", note)


def _ignored(note: str, accepts=None) -> Field:
    return Field("ignored", note, accepts)


def _refused(note: str) -> Field:
    return Field("refused", note)


def _empty(value: Any) -> bool:
    return value in ([], {}, False)


RESPONSES_FIELDS: dict[str, Field] = {
    "model": _honoured("must name the served model (404 otherwise)"),
    "input": _honoured(
        "a string, or items: messages (system/developer, user, assistant; text parts), "
        "function_call and function_call_output"
    ),
    "instructions": _honoured("a system message first; not carried to follow-ups"),
    "max_output_tokens": _honoured("default: up to the context window"),
    "temperature": _honoured(),
    "top_p": _honoured(),
    "stream": _honoured("Server-Sent Events, from response.created to response.completed"),
    "stream_options": _ignored("include_obfuscation: no padding is sent", lambda v: True),
    "store": _honoured(
        "true (default): kept in this process's memory for GET, DELETE and "
        "previous_response_id; the conversation's K/V stays pinned"
    ),
    "previous_response_id": _honoured(
        "the stored response's conversation goes on: its pinned K/V is reused "
        "(cached_tokens), and only the new input is computed; another tenant's is a 404"
    ),
    "tools": _honoured("function tools, where the chat template renders tools"),
    "tool_choice": _honoured("none, auto, required or {type: function, name}"),
    "parallel_tool_calls": _honoured("false keeps the first call"),
    "text": _honoured("format: text, json_object or json_schema (always strict)"),
    "metadata": _honoured("kept with the response and returned as given"),
    "user": _honoured("a routing hint: with --replicas, a user's requests go where its K/V is"),
    "prompt_cache_key": _honoured("a routing hint, as user (prefix caching is automatic)"),
    "truncation": _honoured(
        "disabled (default): a history too long for the window is context_length_exceeded; "
        "auto: the oldest turns after the system prompt give way"
    ),
    "safety_identifier": _ignored("no per-user accounting", lambda v: True),
    "service_tier": _ignored("one tier: auto or default only", lambda v: v in ("auto", "default")),
    "include": _ignored("nothing extra can be included: [] only", _empty),
    "background": _ignored(
        "responses run while their request is open: false only", lambda v: v is False
    ),
    "reasoning": _honoured(
        "effort, where the chat template offers a control (enable_thinking or "
        "reasoning_effort), refused otherwise; the think-tag text comes back as reasoning "
        "items (summary: none is written)"
    ),
    "top_logprobs": _refused("not on this surface (use /v1/chat/completions)"),
    "max_tool_calls": _refused("not supported"),
    "conversation": _refused("no Conversations API: chain responses by previous_response_id"),
    "prompt": _refused("no stored prompt templates"),
    "prompt_cache_retention": _refused("the K/V of a stored response is kept while it is"),
    "prompt_cache_options": _refused("not supported"),
    "context_management": _refused("not supported"),
    "background_options": _refused("no background responses"),
    "moderation": _refused("no moderation"),
    "image": _refused("no image generation"),
    "access_programs": _refused("not supported"),
    # Parley's extensions (vLLM's names)
    "top_k": _honoured("extension"),
    "min_p": _honoured("extension"),
    "seed": _honoured("extension"),
}

MESSAGES_FIELDS: dict[str, Field] = {
    "model": _honoured("must name the served model (404 otherwise)"),
    "messages": _honoured(
        "user and assistant; content a string or text, tool_use and tool_result blocks"
    ),
    "system": _honoured("a string or text blocks: a system message first"),
    "max_tokens": _honoured("required, as Anthropic's API wants it"),
    "stop_sequences": _honoured("up to 16; stop_reason says stop_sequence and which"),
    "stream": _honoured("Server-Sent Events, from message_start to message_stop"),
    "temperature": _honoured(),
    "top_p": _honoured(),
    "top_k": _honoured(),
    "tools": _honoured(
        "custom tools {name, description, input_schema}, where the chat "
        "template renders tools; server tools refused"
    ),
    "tool_choice": _honoured("auto, any, tool (by name) or none; disable_parallel_tool_use"),
    "metadata": _honoured("user_id: a routing hint, as /v1's user"),
    "cache_control": _ignored(
        "prefix caching is automatic: cache_read_input_tokens says what was reused", lambda v: True
    ),
    "service_tier": _ignored(
        "one tier: auto or standard_only", lambda v: v in ("auto", "standard_only")
    ),
    "thinking": _honoured(
        "enabled / adaptive where the chat template offers a reasoning control (refused "
        "otherwise), disabled; the think-tag text comes back as thinking blocks; budget_tokens "
        "does not bound it (max_tokens does)"
    ),
    "container": _refused("no code execution"),
    "mcp_servers": _refused("no MCP connector"),
    "output_config": _refused("not supported"),
    "speed": _refused("not supported"),
    "inference_geo": _refused("one place: this server"),
    "diagnostics": _refused("not supported"),
    "user_profile_id": _refused("not supported"),
    "workspace_id": _refused("not supported"),
}

COUNT_TOKENS_FIELDS: dict[str, Field] = {
    name: MESSAGES_FIELDS[name]
    for name in (
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "cache_control",
        "thinking",
        "output_config",
        "speed",
        "user_profile_id",
        "workspace_id",
        "mcp_servers",
    )
}
