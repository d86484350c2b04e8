"""Conversations the server knows: their history and the token ids of their replies.

A conversation lives in its tenant's namespace and belongs to the owner that started it
(see app.server.security); its `key` is the engine's session id, so its K/V stays pinned
between its turns (see app.engine.session_pins) and two tenants' conversations of the same
id never share a pin. The client's history is the source of truth: a `chat` frame with
`messages` replaces what we remember, and one with only `content` continues it. After a
server restart, or for a client we never saw, the history is simply re-tokenized: the
reply is right, only the reuse is smaller.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from app.chat.prompt import Message
from app.chat.window import Drop

MAX_REPLIES_REMEMBERED = 256  # per conversation: reply text -> the ids the model produced


@dataclass
class Conversation:
    """One conversation's server-side state."""

    id: str
    tenant: str
    owner: str
    messages: list[Message] = field(default_factory=list)
    replies: dict[str, list[int]] = field(default_factory=dict)
    turn: str | None = None  # the token of the turn in flight, if any (unique per turn)
    drop: Drop | None = None  # the oldest messages the model no longer sees (app.chat.window)
    last_active: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> str:
        """Unique across tenants: the engine's session id for this conversation."""
        return conversation_key(self.tenant, self.id)

    def remember_reply(self, text: str, token_ids: list[int]) -> None:
        """Keep `token_ids` as the tokens of reply `text` for splicing into later prompts."""
        if not text:
            return
        self.replies.pop(text, None)
        self.replies[text] = list(token_ids)
        while len(self.replies) > MAX_REPLIES_REMEMBERED:
            del self.replies[next(iter(self.replies))]


def conversation_key(tenant: str, conversation_id: str) -> str:
    return f"{tenant}\x1f{conversation_id}" if tenant else conversation_id


class ConversationStore:
    """Conversations by key, least recently active first, at most `max_conversations`.
    Dropping one (delete, or the oldest when full) calls `on_drop(key)` so that the
    engine lets go of its pinned blocks."""

    def __init__(self, on_drop: Callable[[str], None], max_conversations: int = 10_000):
        self._by_key: OrderedDict[str, Conversation] = OrderedDict()
        self._on_drop = on_drop
        self.max_conversations = max_conversations

    def __len__(self) -> int:
        return len(self._by_key)

    def find(self, tenant: str, conversation_id: str) -> Conversation | None:
        return self._by_key.get(conversation_key(tenant, conversation_id))

    def get(self, tenant: str, conversation_id: str, owner: str) -> Conversation:
        """The conversation, created for `owner` if new, marked as just active. The
        caller checks that `owner` may use it (an existing one may have another)."""
        key = conversation_key(tenant, conversation_id)
        conv = self._by_key.pop(key, None) or Conversation(conversation_id, tenant, owner)
        conv.last_active = time.monotonic()
        self._by_key[key] = conv
        while len(self._by_key) > self.max_conversations:
            idle = next((k for k, c in self._by_key.items() if c.turn is None), None)
            if idle is None:
                break  # every one of them is mid-turn: let the store run over for now
            self._drop(idle)
        return conv

    def delete(self, conv: Conversation) -> None:
        self._drop(conv.key)

    def _drop(self, key: str) -> None:
        self._by_key.pop(key, None)
        self._on_drop(key)
