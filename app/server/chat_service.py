"""Conversations and their turns: between the /ws protocol and the engine.

A turn checks that its conversation belongs to whoever asks, resolves the history (the
client's `messages`, or what we remember plus the new `content`; `content` for a
conversation we do not hold is refused, `unknown_conversation`), builds the prompt with
the conversation's own reply ids spliced in and, when it ends, remembers the reply for the
next turn.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from app.chat.prompt import ChatPrompt, Message
from app.chat.sessions import Conversation, ConversationStore
from app.chat.window import HistoryTooLong, Window, fit, reply_room
from app.config import INLINE_TEXT_CHARS
from app.engine.errors import ContextTooLong
from app.engine.protocol import EngineClient
from app.server import protocol as p
from app.server.security import Principal
from app.server.shares import Share

log = logging.getLogger("parley.chat")

# Histories longer than INLINE_TEXT_CHARS, or than this many messages (each costs the
# template its own work), are rendered and tokenized on a worker thread, not on the event
# loop where every other socket's tokens are sent.
INLINE_RENDER_MESSAGES = 64


def renders_inline(messages: list[Message]) -> bool:
    """Whether a history is small enough to render on the event loop."""
    if len(messages) > INLINE_RENDER_MESSAGES:
        return False
    return sum(len(m.content) for m in messages) <= INLINE_TEXT_CHARS


@dataclass(frozen=True)
class ChatConfig:
    max_turns_per_socket: int = 8
    max_conversations: int = 10_000
    max_connections: int = 256  # open /ws sockets; more are refused with "busy"
    max_connections_per_client: int = 64  # one client's share of them (app.server.shares)
    max_turns_per_client: int = 64  # one client's turns in flight, /ws and /v1 together
    idle_timeout_s: float = 300.0  # a socket carrying no turn that says nothing is closed
    # True: no prefix-cache block computed for one tenant (without keys: one browser
    # client) is reused for another. None: decided by the server (on with several tenants).
    isolate_prefix_cache: bool | None = None


@dataclass
class Turn:
    frame: p.ChatFrame
    conversation: Conversation
    messages: list[Message]  # the history this turn answers
    principal: Principal
    token: str  # unique to this turn: only it can clear its conversation's busy mark
    share: str = ""  # the client's turn share it holds until it ends ("": none)
    recovered: bool = False  # taken from the journal: it may answer an older history
    window: Window | None = None  # what the model sees of `messages` (set by prompt_ids)

    @property
    def dropped(self) -> int:
        """Messages of the history the model does not see (its window is full)."""
        return self.window.dropped if self.window else 0


class ChatService:
    """Conversations and their turns, over one engine."""

    def __init__(self, engine: EngineClient, config: ChatConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ChatConfig()
        info = engine.info
        self.prompt = ChatPrompt(info.tokenizer)
        self.store = ConversationStore(engine.release_session, self.config.max_conversations)
        self.max_model_len = info.max_model_len
        self.max_tokens_limit = info.max_model_len - 1
        self.eos_token_ids = info.eos_token_ids
        self.turns = Share(self.config.max_turns_per_client)  # per client, /ws and /v1

    def cache_salt(self, principal: Principal) -> str | None:
        """The principal's isolation domain: its tenant, or without keys its browser
        lineage (a client that keeps no cookie is a domain per socket or request)."""
        if not self.config.isolate_prefix_cache:
            return None
        return principal.tenant or principal.owner

    def _owned(self, principal: Principal, conv: Conversation, frame_id: str | None) -> None:
        if conv.owner != principal.owner:
            raise p.ProtocolError(
                p.FORBIDDEN,
                f"conversation {conv.id!r} belongs to another client: start a new "
                "conversation id (send the whole history in 'messages' to carry it over)",
                frame_id,
            )

    def check_access(
        self, principal: Principal, conversation_id: str, frame_id: str | None
    ) -> None:
        """Raise ProtocolError (forbidden) when the conversation belongs to another."""
        conv = self.store.find(principal.tenant, conversation_id)
        if conv is not None:
            self._owned(principal, conv, frame_id)

    def begin_turn(self, frame: p.ChatFrame, principal: Principal) -> Turn:
        """Check ownership, mark the conversation busy and resolve its history.
        Raises ProtocolError."""
        conv = self.store.find(principal.tenant, frame.conversation_id)
        if conv is not None:
            self._owned(principal, conv, frame.id)
        elif frame.messages is None:
            # Its history is not here (a restart without a journal, or the store let it
            # go): a reply to the new message alone would silently drop it.
            raise p.ProtocolError(
                p.UNKNOWN_CONVERSATION,
                f"conversation {frame.conversation_id!r} is not held by this server (it "
                "restarted, or let the conversation go): send the whole history with "
                "'messages'",
                frame.id,
            )
        conv = self.store.get(principal.tenant, frame.conversation_id, principal.owner)
        if conv.turn is not None:
            raise p.ProtocolError(
                p.CONVERSATION_BUSY,
                f"conversation {frame.conversation_id!r} already has a turn in flight",
                frame.id,
                retryable=True,
            )
        if frame.messages is not None:
            messages = list(frame.messages)
        else:
            messages = [*conv.messages, Message("user", frame.content or "")]
        if frame.system is not None and messages[0].role != "system":
            messages.insert(0, Message("system", frame.system))
        if not self.turns.take(principal.share):
            raise p.ProtocolError(
                p.TOO_MANY_TURNS,
                f"at most {self.turns.limit} turns in flight per client, over all its "
                "sockets and /v1 requests: retry when one ends",
                frame.id,
                retryable=True,
            )
        turn = Turn(frame, conv, messages, principal, uuid.uuid4().hex, principal.share)
        conv.turn = turn.token
        return turn

    def recovered_turn(self, frame: p.ChatFrame, principal: Principal) -> Turn:
        """A turn taken over from the journal (another process began it): its history is
        `frame.messages`, already resolved; the conversation is marked busy with it."""
        conv = self.store.get(principal.tenant, frame.conversation_id, principal.owner)
        messages = list(frame.messages or [])
        turn = Turn(frame, conv, messages, principal, uuid.uuid4().hex, recovered=True)
        conv.turn = turn.token
        return turn

    async def prompt_ids(self, turn: Turn) -> list[int]:
        """The turn's prompt through the chat template, the conversation's own reply ids
        spliced in, its oldest turns dropped where the window is full (app.chat.window);
        large histories off the event loop. Raises ContextTooLong."""
        frame = turn.frame
        replies = turn.conversation.replies if frame.cache else None
        window = self.max_model_len
        room = reply_room(frame.params.max_tokens, window) if frame.truncate else 1

        def render(messages: list[Message]) -> list[int]:
            return self.prompt.render(messages, replies, continue_final=frame.continue_final)

        def build() -> Window:
            remembered = turn.conversation.drop if frame.truncate else None
            try:
                return fit(turn.messages, render, window, room, frame.truncate, remembered)
            except HistoryTooLong as exc:
                raise ContextTooLong(str(exc), exc.num_tokens, exc.window) from None

        turn.window = build() if renders_inline(turn.messages) else await asyncio.to_thread(build)
        return turn.window.prompt_ids

    def end_turn(self, turn: Turn, text: str | None, reply_ids: list[int] | None) -> None:
        """A turn is over. With its reply text, the conversation grows by it; the reply's
        ids are remembered if they decode to exactly that text."""
        conv = turn.conversation
        if conv.turn == turn.token:
            conv.turn = None
        self.turns.release(turn.share)
        turn.share = ""  # a second end of the same turn releases nothing
        if self.store.find(conv.tenant, conv.id) is None:
            # Deleted while the turn ran on (e.g. detached): the engine pinned the turn's
            # blocks to the session after the delete released it; let them go too.
            self.engine.release_session(conv.key)
            return
        if text is None:
            return
        if turn.recovered and turn.messages[: len(conv.messages)] != conv.messages:
            # The conversation moved on past the history this turn answers (it ran here
            # unjournaled meanwhile, say): its reply must not take the conversation back.
            log.warning("a turn of conversation %s taken from the journal answered an older "
                        "history; its reply is not kept", conv.id)  # fmt: skip
            return
        ids = list(reply_ids or [])
        history = turn.messages
        if turn.frame.continue_final:  # the reply goes on from the last message
            *history, cut = history
            known = conv.replies.get(cut.content) if reply_ids is not None else None
            text = cut.content + text
            if known is None:
                reply_ids = None
            ids = list(known or []) + ids
        conv.messages = [*history, Message("assistant", text)]
        if turn.window is not None and turn.frame.truncate:
            conv.drop = turn.window.drop
        if reply_ids is None or not turn.frame.cache:
            return
        if ids and ids[-1] in self.eos_token_ids:
            ids.pop()  # the template writes the end of turn itself
        if self.prompt.tokenizer.decode(ids, skip_special_tokens=True) == text:
            conv.remember_reply(text, ids)

    def forget(self, turn: Turn) -> None:
        """Another server took this conversation's turn over (this one stalled): the
        history here is stale now, and is forgotten (a `content` gets
        unknown_conversation; the client sends its history again)."""
        conv = turn.conversation
        if self.store.find(conv.tenant, conv.id) is conv:
            self.store.delete(conv)

    def delete(self, principal: Principal, conversation_id: str) -> None:
        """Forget a conversation and free its pinned K/V. Raises ProtocolError when it
        belongs to someone else."""
        conv = self.store.find(principal.tenant, conversation_id)
        if conv is not None:
            self._owned(principal, conv, None)
            self.store.delete(conv)
