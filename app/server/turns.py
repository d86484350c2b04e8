"""Turns of conversations: between the /ws protocol and the engine.

A turn resolves its conversation's history (the client's `messages`, or what we remember
plus the new `content`), builds the prompt with the conversation's own reply ids spliced
in, and, when it ends, remembers the reply for the next turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from app.chat.prompt import ChatPrompt, Message
from app.chat.sessions import Conversation, ConversationStore
from app.engine.engine import RequestOutput
from app.server import protocol as p

log = logging.getLogger("parley.chat")


class Engine(Protocol):
    """What the chat layer needs from an engine (AsyncEngine, or a fake in tests)."""

    tokenizer: Any
    max_model_len: int
    eos_token_ids: frozenset[int]

    def generate(self, prompt, params, request_id=None, session_id=None) -> Any: ...
    def abort(self, request_id: str) -> None: ...
    def release_session(self, session_id: str) -> None: ...


@dataclass(frozen=True)
class ChatConfig:
    max_turns_per_socket: int = 8
    max_conversations: int = 10_000
    max_connections: int = 256  # open /ws sockets; more are refused with "busy"


@dataclass
class Turn:
    frame: p.ChatFrame
    conversation: Conversation
    messages: list[Message]  # the history this turn answers
    prompt_ids: list[int]


class ChatService:
    """Conversations and their turns, over one engine."""

    def __init__(self, engine: Engine, config: ChatConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ChatConfig()
        self.prompt = ChatPrompt(engine.tokenizer)
        self.store = ConversationStore(engine.release_session, self.config.max_conversations)
        self.max_tokens_limit = engine.max_model_len - 1
        self.connections = 0  # open /ws sockets (event-loop only)

    def begin_turn(self, frame: p.ChatFrame) -> Turn:
        """Resolve history and prompt. Raises ProtocolError."""
        conv = self.store.get(frame.conversation_id)
        if conv.turn_id is not None:
            raise p.ProtocolError(
                p.CONVERSATION_BUSY,
                f"conversation {frame.conversation_id!r} already has turn {conv.turn_id!r} "
                "in flight",
                frame.id,
                retryable=True,
            )
        if frame.messages is not None:
            messages = list(frame.messages)
        else:
            messages = [*conv.messages, Message("user", frame.content or "")]
        if frame.system is not None and messages[0].role != "system":
            messages.insert(0, Message("system", frame.system))
        prompt_ids = self.prompt.render(messages, conv.replies if frame.cache else None)
        limit = self.engine.max_model_len
        if len(prompt_ids) >= limit:
            raise p.ProtocolError(
                p.TOO_LONG,
                f"the conversation is {len(prompt_ids)} tokens long; the context window is "
                f"{limit} tokens, and the reply needs at least one: shorten or start anew",
                frame.id,
            )
        conv.turn_id = frame.id
        return Turn(frame, conv, messages, prompt_ids)

    def end_turn(self, turn: Turn, text: str | None, reply_ids: list[int] | None) -> None:
        """A turn is over. With its reply text, the conversation grows by it; the reply's
        ids are remembered if they decode to exactly that text."""
        conv = turn.conversation
        if conv.turn_id == turn.frame.id:
            conv.turn_id = None
        if text is None:
            return
        conv.messages = [*turn.messages, Message("assistant", text)]
        if reply_ids is None or not turn.frame.cache:
            return
        ids = list(reply_ids)
        if ids and ids[-1] in self.engine.eos_token_ids:
            ids.pop()  # the template writes the end of turn itself
        if self.engine.tokenizer.decode(ids, skip_special_tokens=True) == text:
            conv.remember_reply(text, ids)

    def delete(self, conversation_id: str) -> bool:
        """Forget a conversation and free its pinned K/V."""
        return self.store.delete(conversation_id)

    @staticmethod
    def usage(out: RequestOutput) -> p.Usage:
        return p.Usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)

    @staticmethod
    def timings(out: RequestOutput) -> p.Timings:
        t = out.timings
        ttft = None if t.first_token is None else (t.first_token - t.arrival) * 1000
        queue = None if t.first_scheduled is None else (t.first_scheduled - t.arrival) * 1000
        total = None if t.finished is None else (t.finished - t.arrival) * 1000
        rate = None
        if t.finished is not None and t.first_token is not None and out.completion_tokens > 1:
            span = t.finished - t.first_token
            rate = (out.completion_tokens - 1) / span if span > 0 else None
        return p.Timings(ttft, rate, queue, total)

    def log_turn(self, turn: Turn, out: RequestOutput, reason: str) -> None:
        t = self.timings(out)
        log.info(
            "turn done: conversation=%s prompt=%d cached=%d completion=%d ttft=%s ms "
            "tok/s=%s finish=%s",
            turn.frame.conversation_id,
            out.prompt_tokens,
            out.cached_tokens,
            out.completion_tokens,
            "-" if t.ttft_ms is None else f"{t.ttft_ms:.0f}",
            "-" if t.tokens_per_s is None else f"{t.tokens_per_s:.1f}",
            reason,
        )
