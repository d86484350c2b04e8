"""What a conversation keeps when it outgrows the model's context window.

A conversation's prompt is its whole history through the chat template. When the next
turn would not fit (its prompt and room for the reply, `reply_room`), the oldest turns
after the system prompt give way: whole turns (a user message and the replies after it),
never the system prompt, never the turn being answered. The kept messages are rendered
again, so the prompt is exactly that shorter history, and the pinned K/V that the turn
leaves behind is the K/V of what the model saw: a later turn reuses it as it would a
fresh conversation's (tests/chat/test_window.py checks the reply against one).

Two choices keep the pinned K/V useful. A conversation that has dropped turns goes on
dropping at least those (`Drop`, remembered per conversation and checked against the
history's first messages), so its prompt keeps its beginning and each turn's prompt
reuses the last one's K/V, instead of the model seeing an old turn again the moment a
short message would let it fit. And when more must go, enough goes to leave a quarter of
the window free (`SLACK`), so that the prefix changes (and the prompt is computed anew)
once every few turns rather than every turn, as llama.cpp's context shift discards half.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.chat.prompt import Message

SLACK = 4  # dropping leaves 1/SLACK of the window free where it can


class HistoryTooLong(ValueError):
    """Even with every turn that may go gone, the prompt fills the window."""

    def __init__(self, message: str, num_tokens: int, window: int) -> None:
        super().__init__(message)
        self.num_tokens = num_tokens
        self.window = window


@dataclass(frozen=True)
class Drop:
    """Messages a conversation no longer shows the model: the first `count` after its
    system prompt, and a digest of them (a history that starts otherwise starts anew)."""

    count: int
    digest: str


@dataclass(frozen=True)
class Window:
    """What the model sees of a history: the kept messages, their prompt ids, and how many
    messages (after the system prompt) were left out."""

    messages: list[Message]
    prompt_ids: list[int]
    dropped: int
    drop: Drop | None  # to remember for the conversation's next turn


def reply_room(max_tokens: int | None, window: int) -> int:
    """The tokens a reply is promised before older turns give way: max_tokens, up to a
    quarter of the window (a longer reply stops at the window's end, "length"); an eighth
    of the window when the turn sets no max_tokens."""
    if max_tokens:
        return max(1, min(max_tokens, window // 4))
    return max(1, window // 8)


def _digest(messages: Sequence[Message]) -> str:
    h = hashlib.sha256()
    for m in messages:
        h.update(m.role.encode() + b"\0" + m.content.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:32]


def _turn_starts(body: Sequence[Message]) -> list[int]:
    """Where each turn of `body` (the history after its system prompt) begins: at each user
    message, and at 0 for whatever comes before the first one."""
    starts = [i for i, m in enumerate(body) if m.role == "user"]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return starts


def fit(
    messages: Sequence[Message],
    render: Callable[[list[Message]], list[int]],
    window: int,
    room: int,
    truncate: bool,
    remembered: Drop | None = None,
) -> Window:
    """The longest tail of `messages` (after its system prompt) whose prompt leaves `room`
    tokens in a window of `window` (without `truncate`, the whole history). When no more
    may go, a prompt that leaves less room still runs; one that fills the window raises
    HistoryTooLong."""
    messages = list(messages)
    head = 0
    while head < len(messages) and messages[head].role == "system":
        head += 1
    system, body = messages[:head], messages[head:]
    # Turns that may go: all but the last (the one being answered).
    cuts = _turn_starts(body)[1:]  # k turns dropped: the first cuts[k - 1] messages
    start = 0  # turns dropped at least
    if (
        remembered is not None
        and remembered.count in cuts
        and _digest(body[: remembered.count]) == remembered.digest
    ):
        start = cuts.index(remembered.count) + 1

    def attempt(k: int) -> tuple[list[Message], list[int]]:
        cut = 0 if k == 0 else cuts[k - 1]
        kept = system + body[cut:]
        return kept, render(kept)

    def result(k: int, kept: list[Message], ids: list[int]) -> Window:
        cut = 0 if k == 0 else cuts[k - 1]
        drop = Drop(cut, _digest(body[:cut])) if cut else None
        return Window(kept, ids, cut, drop)

    kept, ids = attempt(start)
    if len(ids) + room <= window:
        return result(start, kept, ids)
    k = start
    if truncate and start < len(cuts):
        # The fewest turns dropped that leave the slack (or, failing that, the room): the
        # prompt only shortens as k grows, so each is a binary search over k.
        found: dict[int, tuple[list[Message], list[int]]] = {}

        def fewest(limit: int) -> int | None:
            lo, hi, best = start + 1, len(cuts), None
            while lo <= hi:
                mid = (lo + hi) // 2
                found.setdefault(mid, attempt(mid))
                if len(found[mid][1]) + room <= limit:
                    best, hi = mid, mid - 1
                else:
                    lo = mid + 1
            return best

        best = fewest(window - window // SLACK)
        if best is None:
            best = fewest(window)
        k = len(cuts) if best is None else best
        kept, ids = found.get(k) or attempt(k)
        if best is not None:
            return result(k, kept, ids)
    if len(ids) < window:  # nothing more may go: the reply gets what room is left
        return result(k, kept, ids)
    raise _too_long(len(ids), window, room, truncate)


def _too_long(tokens: int, window: int, room: int, truncated: bool) -> HistoryTooLong:
    if truncated:
        message = (
            f"the latest message is too long: with only the system prompt before it, the prompt "
            f"is {tokens} tokens long; the context window is {window} tokens: shorten it"
        )
    else:
        message = (
            f"the conversation is {tokens} tokens long; the context window is {window} tokens, "
            f"with {room} kept for the reply: shorten it or start anew"
        )
    return HistoryTooLong(message, tokens, window)
