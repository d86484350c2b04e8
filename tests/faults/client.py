"""The fault suite's clients: each holds conversations of a few turns against the two
servers as a resilient client would (the page, say), and writes down what it saw.

A turn is sent to the conversation's server (`content` where that server answered the
conversation last, the whole history in `messages` elsewhere or when told
`unknown_conversation`). While it streams, the client may drop its socket (a fault of its
own) and resume on a new socket from a random seq at or before the last one it has, on the
server it was on, or on the other when that one does not have the turn (taken over, or
restarted and not yet taken back). Every frame is checked as it comes: a seq seen before
must bring the same text, a new one must be the next; and each turn's prompt must be longer
than the conversation's previous one (its history never shrinks).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import websockets

from tests.faults.cluster import KEY, SERVERS, Cluster

TURNS_PER_CONVERSATION = 3
RETRYABLE = {"unavailable", "busy", "conversation_busy", "too_many_turns"}
NETWORK_ERRORS = (OSError, TimeoutError, websockets.ConnectionClosed, websockets.InvalidHandshake)


@dataclass
class Observation:
    """What the client saw of one turn."""

    conversation: str
    turn_id: str
    accepted: bool = False  # it saw the turn's start
    refusals: list[str] = field(default_factory=list)  # codes it was refused with, before
    texts: dict[int, str] = field(default_factory=dict)  # token text by seq
    terminal: dict | None = None
    given_up: bool = False  # never seen accepted, asked again under a new id
    problems: list[str] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)  # where it streamed from
    sent_at: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0  # as its start said

    @property
    def text(self) -> str:
        return "".join(self.texts[s] for s in sorted(self.texts))


class Ledger:
    """Every turn the clients sent, and the faults injected, by kind."""

    def __init__(self) -> None:
        self.turns: list[Observation] = []
        self.faults: Counter[str] = Counter()


class _Again(Exception):
    """Go round again: on another socket, maybe another server."""


class Client:
    def __init__(self, index: int, cluster: Cluster, ledger: Ledger, rng: random.Random,
                 max_tokens: int, drop_chance: float, patience_s: float) -> None:  # fmt: skip
        self.index = index
        self.cluster, self.ledger, self.rng = cluster, ledger, rng
        self.max_tokens, self.drop_chance, self.patience_s = max_tokens, drop_chance, patience_s
        self.home = SERVERS[index % len(SERVERS)]
        self.conversation = ""
        self.history: list[dict] = []
        self.held: set[str] = set()  # servers that hold the conversation's history
        self.last_prompt = 0
        self._sent = False  # the current attempt's frame went out

    async def run(self, going) -> None:
        """Turn after turn while `going()`."""
        n = 0
        while going():
            if n % TURNS_PER_CONVERSATION == 0:
                self.conversation = f"c{self.index}-{n}"
                self.history, self.held, self.last_prompt = [], set(), 0
            await self.turn(f"t{n}", f"Name a color, {n}.")
            n += 1

    async def turn(self, turn_id: str, question: str) -> None:
        obs = Observation(self.conversation, turn_id)
        self.ledger.turns.append(obs)
        where, mode, after = self.home, "send", -1
        deadline = time.monotonic() + self.patience_s
        unknown_since: float | None = None
        while obs.terminal is None:
            if time.monotonic() > deadline:
                obs.problems.append(f"lost: no terminal within {self.patience_s:g} s")
                return
            self._sent = False
            try:
                if mode == "resume":
                    after = self.rng.randint(-1, max(obs.texts, default=-1))
                await self._stream(obs, where, mode, question, after)
            except _Again as again:
                mode, where = again.args
                if mode == "resume" and not obs.accepted and not obs.texts:
                    # Sent, but never seen taken: after a claim's time on both servers it was
                    # not accepted at all, and is asked again under a new id.
                    unknown_since = unknown_since or time.monotonic()
                    if time.monotonic() - unknown_since > 2 * self.cluster.claim_after_s + 5:
                        obs.given_up = True
                        return await self.turn(turn_id + "'", question)
                await asyncio.sleep(0.2)
            except NETWORK_ERRORS:
                if mode == "send" and self._sent:
                    mode = "resume"  # it may have been accepted before the socket went
                elif mode == "send" or where in self.cluster.down:
                    where = self._other(where)  # not sent: ask the other server
                await asyncio.sleep(0.3)
        if obs.terminal["type"] == "done":
            self.history += [{"role": "user", "content": question},
                             {"role": "assistant", "content": obs.text}]  # fmt: skip
            self.held = {obs.servers[-1]}
            self.last_prompt = obs.prompt_tokens

    async def _stream(self, obs: Observation, where: str, mode: str, question: str,
                      after: int) -> None:  # fmt: skip
        url = self.cluster.url(where, "ws") + "/ws"
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(url, additional_headers=headers, open_timeout=5,
                                      close_timeout=1, max_size=None) as ws:  # fmt: skip
            await ws.send(json.dumps(self._frame(obs, where, mode, question, after)))
            self._sent = True
            drop_after = None
            if self.rng.random() < self.drop_chance:
                drop_after = self.rng.randint(1, self.max_tokens)
            fresh = 0
            while True:
                f = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if f["type"] == "start":
                    self._started(obs, f, mode)
                elif f["type"] == "token":
                    fresh += self._token(obs, f, mode, after)
                    if drop_after is not None and fresh >= drop_after:
                        ws.transport.abort()  # the network is gone: no close handshake
                        self.ledger.faults["client drop, resume at a random seq"] += 1
                        raise _Again("resume", where)
                elif f["type"] == "done":
                    obs.servers.append(where)
                    obs.terminal = f
                    return
                elif f["type"] == "error":
                    self._error(obs, f, where, mode)
                    return

    def _frame(self, obs: Observation, where: str, mode: str, question: str, after: int):
        if mode == "resume":
            return {"type": "resume", "id": obs.turn_id, "conversation_id": obs.conversation,
                    "after_seq": after}  # fmt: skip
        frame = {"type": "chat", "id": obs.turn_id, "conversation_id": obs.conversation,
                 "params": {"temperature": 0, "max_tokens": self.max_tokens,
                            "ignore_eos": True}}  # fmt: skip
        if where in self.held and self.history:
            frame["content"] = question
        else:
            frame["messages"] = [*self.history, {"role": "user", "content": question}]
        return frame

    def _started(self, obs: Observation, f: dict, mode: str) -> None:
        # Longer than the conversation's last answered turn's: that one and its reply are in.
        if not obs.accepted and f["prompt_tokens"] <= self.last_prompt:
            obs.problems.append(f"history shrank: a prompt of {f['prompt_tokens']} tokens "
                                f"after one of {self.last_prompt}")  # fmt: skip
        if not obs.accepted:
            obs.prompt_tokens = f["prompt_tokens"]
        obs.accepted = True

    def _token(self, obs: Observation, f: dict, mode: str, after: int) -> int:
        seq, text = f["seq"], f["text"]
        if mode == "resume" and seq <= after:
            obs.problems.append(f"seq {seq} sent again after a resume from {after}")
        if seq in obs.texts:
            if obs.texts[seq] != text:
                obs.problems.append(f"seq {seq} changed: {obs.texts[seq]!r} -> {text!r}")
            return 0
        if seq != max(obs.texts, default=-1) + 1:
            obs.problems.append(f"seq {seq} after {max(obs.texts, default=-1)}: a gap")
        obs.texts[seq] = text
        return 1

    def _error(self, obs: Observation, f: dict, where: str, mode: str) -> None:
        code = f["code"]
        if code == "unknown_conversation" and mode == "send":
            self.held.discard(where)
            raise _Again("send", where)
        if mode == "send" and not obs.accepted and code in RETRYABLE:
            obs.refusals.append(code)  # not accepted: asked again
            raise _Again("send", where)
        if obs.accepted and code == "unavailable":  # taken over: it goes on elsewhere
            raise _Again("resume", self._other(where))
        if mode == "resume" and code in ("unknown_id", "unavailable"):
            raise _Again("resume", self._other(where))
        if code in ("expired", "internal", "forbidden"):
            obs.problems.append(f"{code}: {f['message']}")
        obs.servers.append(where)
        obs.terminal = f

    def _other(self, server: str) -> str:
        return next(s for s in SERVERS if s != server)
