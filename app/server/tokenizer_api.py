"""What people debug prompts with: POST /tokenize, /detokenize and /apply-template.

- /tokenize: a `prompt` string, or chat `messages` (OpenAI's shape, with `tools` where the
  template renders them) through the chat template exactly as /v1/chat/completions builds
  the prompt, -> the token ids, their count, the context window and each token's text.
- /detokenize: `tokens` -> the text they decode to and each token's text.
- /apply-template: chat `messages` -> the chat template's text (no tokenizing).

A token's text is the text of its own bytes (a piece of a multi-byte character shows as
U+FFFD); `bytes` gives them exactly.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.chat.prompt import Message
from app.chat.tools import supports_tools
from app.server.api_turn import check_model, endpoint, read_json, render, template_text
from app.server.chat_service import ChatService
from app.server.openai_fields import Field
from app.server.openai_request import ToolUse, bad, chat_messages, tool_use
from app.server.openai_response import TokenTexts

MAX_DETOKENIZE = 1 << 17  # token ids a request may send

_MODEL = Field("honoured", "must name the served model (404 otherwise)")
_MESSAGES = Field("honoured", "OpenAI's chat messages, as /v1/chat/completions takes them")
_TOOLS = Field("honoured", "OpenAI's tool definitions, where the chat template renders tools")
_GENERATION = Field("honoured", "default true: end with the assistant's turn opened")

TOKENIZE_FIELDS: dict[str, Field] = {
    "model": _MODEL,
    "prompt": Field("honoured", "a string, tokenized as is (no special tokens added)"),
    "add_special_tokens": Field("honoured", "with prompt: the tokenizer's BOS and the like"),
    "messages": _MESSAGES,
    "tools": _TOOLS,
    "add_generation_prompt": _GENERATION,
}
DETOKENIZE_FIELDS: dict[str, Field] = {
    "model": _MODEL,
    "tokens": Field("honoured", "token ids"),
    "skip_special_tokens": Field("honoured", "default false: special tokens are shown"),
}
TEMPLATE_FIELDS: dict[str, Field] = {
    "model": _MODEL,
    "messages": _MESSAGES,
    "tools": _TOOLS,
    "add_generation_prompt": _GENERATION,
}


class TokenizerAPI:
    """The handlers, over the app's ChatService (its tokenizer and chat prompt)."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat
        self.tokenizer = chat.prompt.tokenizer
        self.texts = TokenTexts(self.tokenizer)
        self.model_name = chat.engine.info.name
        self.template_has_tools = supports_tools(self.tokenizer)

    def _pieces(self, ids: list[int]) -> list[dict[str, Any]]:
        return [
            {"id": t, "text": self.texts.text(t), "bytes": list(self.texts.bytes(t))} for t in ids
        ]

    def _chat(self, body: dict[str, Any]) -> tuple[list[Message], ToolUse | None, bool]:
        tools = tool_use({"tools": body.get("tools")}, self.template_has_tools)
        messages = chat_messages(body, self.template_has_tools)
        generation = body.get("add_generation_prompt", True)
        if not isinstance(generation, bool):
            raise bad("add_generation_prompt must be a boolean", "add_generation_prompt")
        return messages, tools, generation

    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request, TOKENIZE_FIELDS)
        check_model(body, self.model_name)
        prompt = body.get("prompt")
        if (prompt is None) == (body.get("messages") is None):
            raise bad("give a prompt or messages (one of them)", "prompt")
        if prompt is not None:
            special = body.get("add_special_tokens", False)
            if not isinstance(prompt, str) or not isinstance(special, bool):
                raise bad("prompt must be a string, add_special_tokens a boolean", "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=special)
        else:
            messages, tools, generation = self._chat(body)
            if generation:  # as the server builds a prompt
                ids = await render(self.chat, messages, tools)
            else:
                text = template_text(self.chat, messages, tools, generation_prompt=False)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
        return JSONResponse(
            {
                "tokens": ids,
                "count": len(ids),
                "max_model_len": self.chat.max_model_len,
                "pieces": self._pieces(ids),
            }
        )

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, DETOKENIZE_FIELDS)
        check_model(body, self.model_name)
        ids, skip = body.get("tokens"), body.get("skip_special_tokens", False)
        vocab = len(self.tokenizer)
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
        ):
            raise bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        if len(ids) > MAX_DETOKENIZE:
            raise bad(f"at most {MAX_DETOKENIZE} tokens", "tokens")
        if not isinstance(skip, bool):
            raise bad("skip_special_tokens must be a boolean", "skip_special_tokens")
        text = self.tokenizer.decode(ids, skip_special_tokens=skip)
        return JSONResponse({"prompt": text, "pieces": self._pieces(ids)})

    async def apply_template(self, request: Request) -> Response:
        body = await read_json(request, TEMPLATE_FIELDS)
        check_model(body, self.model_name)
        messages, tools, generation = self._chat(body)
        return JSONResponse({"prompt": template_text(self.chat, messages, tools, generation)})


def routes() -> list[Route]:
    def api(request: Request) -> TokenizerAPI:
        return request.state.tokenizer_api

    return [
        endpoint(api, TokenizerAPI.tokenize, path="/tokenize"),
        endpoint(api, TokenizerAPI.detokenize, path="/detokenize"),
        endpoint(api, TokenizerAPI.apply_template, path="/apply-template"),
    ]
