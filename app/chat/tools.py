"""Tools (function calling) for models whose chat template renders them.

Whether a model can call tools is read off its chat template: one that mentions `tools`
renders the definitions it is given (transformers passes them as `tools`). The default
model's (SmolLM2-135M-Instruct) does not, so a request with tools is refused there rather
than answered as if the tools were not there.

A reply's calls are parsed in the format of the model's family, as the reply streams
(app.chat.formats). `tool_choice` "required" or a named function constrains the reply
instead: it must be one JSON call object whose arguments follow the tool's parameter
schema (a response_format).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tool definitions."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(template.values())
    return "tools" in template


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's `tool_calls[i]`."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall("call_" + uuid.uuid4().hex[:24], obj["name"], text)


def parse_forced_call(text: str) -> list[ToolCall]:
    """The call of a reply constrained by forced_call_schema (a JSON call object)."""
    try:
        call = _call(json.loads(text))
    except json.JSONDecodeError:
        return []
    return [call] if call else []


def forced_call_schema(tools: Sequence[Mapping[str, Any]], name: str | None) -> dict[str, Any]:
    """A JSON Schema for one call of the named tool (or of any of `tools`)."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    "arguments": fn.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}
