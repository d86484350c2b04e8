"""Messages -> token ids through the tokenizer's chat template, splicing in the model's
own token ids for replies it generated.

Re-tokenizing a reply's text need not give back the ids the model produced ("Par" + "is"
may come back as "Paris"), and the first differing token would end the reuse of the
conversation's pinned K/V right there. So each assistant message whose text equals a reply
this conversation generated goes in as the generated ids: reuse stays token-exact and the
prompt is what the model actually saw.

How: the template is rendered with a unique marker in place of each such reply, the text
between markers is tokenized piece by piece, and the ids go in between. In ChatML (and most
templates) a reply sits between a newline and an end-of-turn special token, both of which
end a pre-token, so tokenizing in pieces gives the same ids as tokenizing the whole.

The pieces of a conversation's next prompt are its last prompt's pieces plus one, so their
ids are kept (a bounded cache by text): a turn tokenizes its new message, not its whole
history again.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
_MARK = "\ue000parley-reply-{}\ue001"  # private-use characters: never in real text
_MARK_RE = re.compile("\ue000parley-reply-(\\d+)\ue001")
PIECES_KEPT_CHARS = 4 << 20  # text of the pieces whose ids are kept, at most


@dataclass(frozen=True)
class Message:
    role: str  # ROLES, or "tool" (the result of a tool call, where templates know tools)
    content: str
    # An assistant's tool calls ({"id", "type": "function", "function": {"name",
    # "arguments"}}, as OpenAI's) and a tool message's answer to one: for templates that
    # render tools only (app.chat.tools).
    tool_calls: tuple[Mapping[str, Any], ...] | None = None
    tool_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class ChatPrompt:
    """Builds prompts for one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        # Piece text -> its ids, least recently used first. Large histories render on a
        # worker thread while small ones render on the event loop: a lock guards it.
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._pieces_chars = 0
        self._lock = threading.Lock()

    def render(
        self,
        messages: Sequence[Message],
        generated: Mapping[str, list[int]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final: bool = False,
        template_args: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of `messages`, ready for the assistant's reply. `generated` maps a
        reply's text to the ids the model produced for it; `tools` (OpenAI's tool
        definitions) go to a template that renders them (app.chat.tools). With
        `continue_final`, the last message (the assistant's, cut at its length limit) is
        left open for the reply to go on from its last token. `template_args` go to the
        template as variables (enable_thinking, reasoning_effort: app.chat.formats)."""
        generated = generated or {}
        spliced: list[list[int]] = []
        items = []
        for m in messages:
            content = m.content
            if m.role == "assistant" and content in generated and content:
                content = _MARK.format(len(spliced))
                spliced.append(generated[m.content])
            items.append({**m.to_dict(), "content": content})
        extra = {"tools": list(tools)} if tools else {}
        extra.update(template_args or {})
        text = self.tokenizer.apply_chat_template(
            items,
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            **extra,
        )
        ids: list[int] = []
        pos = 0
        for match in _MARK_RE.finditer(text):
            ids += self._encode(text[pos : match.start()])
            ids += spliced[int(match.group(1))]
            pos = match.end()
        ids += self._encode(text[pos:])
        return ids

    def _encode(self, text: str) -> tuple[int, ...]:
        if not text:
            return ()
        with self._lock:
            ids = self._pieces.get(text)
            if ids is not None:
                self._pieces.move_to_end(text)
                return ids
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        if len(text) <= PIECES_KEPT_CHARS // 8:
            with self._lock:
                if text not in self._pieces:
                    self._pieces[text] = ids
                    self._pieces_chars += len(text)
                while self._pieces_chars > PIECES_KEPT_CHARS:
                    old, _ = self._pieces.popitem(last=False)
                    self._pieces_chars -= len(old)
        return ids
