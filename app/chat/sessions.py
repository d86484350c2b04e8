"""Conversations the server knows: their history and the token ids of their replies.

A conversation id is the engine's session id, so a conversation's K/V stays pinned between
its turns (see app.engine.session_pins). The client's history is the source of truth: a
`chat` frame with `messages` replaces what we remember, and one with only `content`
continues it. After a server restart, or for a client we never saw, the history is simply
re-tokenized: the reply is right, only the reuse is smaller.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from app.chat.prompt import Message

MAX_REPLIES_REMEMBERED = 256  # per conversation: reply text -> the ids the model produced


@dataclass
class Conversation:
    """One conversation's server-side state."""

    id: str
    messages: list[Message] = field(default_factory=list)
    replies: dict[str, list[int]] = field(default_factory=dict)
    turn_id: str | None = None  # the request in flight, if any
    last_active: float = field(default_factory=time.monotonic)

    def remember_reply(self, text: str, token_ids: list[int]) -> None:
        """Keep `token_ids` as the tokens of reply `text` for splicing into later prompts."""
        if not text:
            return
        self.replies.pop(text, None)
        self.replies[text] = list(token_ids)
        while len(self.replies) > MAX_REPLIES_REMEMBERED:
            del self.replies[next(iter(self.replies))]


class ConversationStore:
    """Conversations by id, least recently active first, at most `max_conversations`.
    Dropping one (delete, or the oldest when full) calls `on_drop(id)` so that the
    engine lets go of its pinned blocks."""

    def __init__(self, on_drop: Callable[[str], None], max_conversations: int = 10_000):
        self._by_id: OrderedDict[str, Conversation] = OrderedDict()
        self._on_drop = on_drop
        self.max_conversations = max_conversations

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, conversation_id: str) -> bool:
        return conversation_id in self._by_id

    def get(self, conversation_id: str) -> Conversation:
        """The conversation, created if new, marked as just active."""
        conv = self._by_id.pop(conversation_id, None) or Conversation(conversation_id)
        conv.last_active = time.monotonic()
        self._by_id[conversation_id] = conv
        while len(self._by_id) > self.max_conversations:
            idle = next((cid for cid, c in self._by_id.items() if c.turn_id is None), None)
            if idle is None:
                break  # every one of them is mid-turn: let the store run over for now
            self.delete(idle)
        return conv

    def delete(self, conversation_id: str) -> bool:
        conv = self._by_id.pop(conversation_id, None)
        self._on_drop(conversation_id)
        return conv is not None
