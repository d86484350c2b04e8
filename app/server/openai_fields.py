"""Every field of an OpenAI request, and what Parley does with it: honoured, accepted and
ignored for a stated reason, or refused with a 400 naming it. Nothing is dropped silently:
a field that is in neither table (a typo, a newer API's field) is refused too.

docs/openai_api.md shows these tables (tests/server/test_openai_fields.py keeps them in step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.server.errors import APIError


@dataclass(frozen=True)
class Field:
    """How a request field is treated. `accepts` (for an ignored field) says which values
    may pass unnoticed; any other value is refused, with `note` as the reason."""

    handling: str  # "honoured", "ignored" or "refused"
    note: str
    accepts: Callable[[Any], bool] | None = None


def _honoured(note: str = "") -> Field:
    return Field("honoured", note)


def _ignored(note: str, accepts: Callable[[Any], bool] | None = None) -> Field:
    return Field("ignored", note, accepts)


def _refused(note: str) -> Field:
    return Field("refused", note)


_COMMON: dict[str, Field] = {
    "model": _honoured("must name the served model (404 otherwise)"),
    "max_tokens": _honoured("default: up to the context window"),
    "temperature": _honoured(),
    "top_p": _honoured(),
    "n": _honoured("choices share the prompt's KV blocks; at most max_num_seqs"),
    "stream": _honoured(),
    "stream_options": _honoured("include_usage; include_obfuscation is accepted (no padding)"),
    "stop": _honoured("a string or up to 16 strings"),
    "seed": _honoured("choice i of n uses seed + i"),
    "presence_penalty": _honoured(),
    "frequency_penalty": _honoured(),
    "logit_bias": _honoured("token id -> bias in [-100, 100], added before penalties"),
    "user": _honoured("a routing hint: with --replicas, a user's requests go where its K/V is"),
    # Parley's extensions (vLLM's names)
    "top_k": _honoured("extension"),
    "min_p": _honoured("extension"),
    "repetition_penalty": _honoured("extension"),
    "ignore_eos": _honoured("extension, for benchmarks"),
}

CHAT_FIELDS: dict[str, Field] = {
    "messages": _honoured("system/developer, user, assistant (and tool where tools work)"),
    **_COMMON,
    "max_completion_tokens": _honoured("the same as max_tokens"),
    "logprobs": _honoured("of the model's logits, before penalties and masks"),
    "top_logprobs": _honoured("0-20, with logprobs: true"),
    "response_format": _honoured("text, json_object, json_schema (always strict)"),
    "tools": _honoured("where the chat template renders tools; refused otherwise"),
    "tool_choice": _honoured("none, auto, required or a named function, with tools"),
    "parallel_tool_calls": _honoured("false keeps the first call"),
    "metadata": _ignored("tags for stored completions, and nothing is stored"),
    "store": _ignored("nothing is stored: false only", lambda v: v is False),
    "safety_identifier": _ignored("no per-user accounting"),
    "prompt_cache_key": _honoured("a routing hint, as user (prefix caching is automatic)"),
    "truncation": _honoured(
        "extension (the Responses API's): auto drops the oldest turns after the system "
        "prompt when the history outgrows the window, and says how many messages in the "
        "x-parley-truncated-messages header; disabled (default): context_length_exceeded"
    ),
    "service_tier": _ignored("one tier: auto or default only", lambda v: v in ("auto", "default")),
    "prediction": _ignored("a latency hint: the reply does not depend on it"),
    "modalities": _ignored("text is the only modality", lambda v: v == ["text"]),
    "audio": _refused("no audio output"),
    "functions": _refused("deprecated: use tools"),
    "function_call": _refused("deprecated: use tool_choice"),
    "reasoning_effort": _honoured(
        "where the chat template offers a control (enable_thinking or reasoning_effort), "
        "refused otherwise; the think-tag text comes back as reasoning_content"
    ),
    "verbosity": _refused("not supported"),
    "web_search_options": _refused("no web search"),
}

COMPLETION_FIELDS: dict[str, Field] = {
    "prompt": _honoured("a string, or token ids (one prompt a request)"),
    **_COMMON,
    "logprobs": _honoured("0-5 alternatives per token"),
    "echo": _honoured("the prompt comes back first, with its logprobs when asked"),
    "best_of": _honoured("equal to n only: picking the best of more is refused"),
    "response_format": _honoured("extension: as in chat"),
    "suffix": _refused("no fill-in-the-middle"),
}


def check_fields(body: Mapping[str, Any], table: Mapping[str, Field]) -> None:
    """Raise APIError(400) naming the first field the request may not have."""
    for name, value in body.items():
        field = table.get(name)
        if field is None:
            raise APIError(400, f"unknown field '{name}': Parley does not support it", param=name)
        if value is None or field.handling == "honoured":
            continue
        if field.handling == "refused" or (field.accepts is not None and not field.accepts(value)):
            raise APIError(400, f"'{name}' is not supported here: {field.note}", param=name)
