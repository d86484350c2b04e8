"""What the journal keeps of a turn (app.server.journal), and how it reads back.

A turn's record is a Redis list: its header (a TurnRecord as JSON: who, which
conversation, the history, the prompt's token ids, the sampling parameters), then one item
per token frame sent, `{"s": seq, "t": text, "i": [token ids since the last item]}` (the
first with `"start": [prompt_tokens, cached_tokens, tier_cached_tokens]`), then its end,
`{"end": terminal frame, "ok": bool, "i": [...]}`. A record is named by its conversation
and turn id, so a resume after a restart can find a finished turn's record without the
stream entry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from app.chat.prompt import Message
from app.engine.request import ResponseFormat, SamplingParams

VERSION = 1


@dataclass(frozen=True)
class TurnRecord:
    """What the journal keeps of an accepted turn: enough to run it again elsewhere."""

    tenant: str
    owner: str
    conversation_id: str
    turn_id: str
    messages: list[Message]  # the history it answers, resolved
    params: SamplingParams
    cache: bool
    cache_salt: str | None
    prompt_ids: list[int]

    def to_json(self) -> str:
        return json.dumps(
            {
                "v": VERSION,
                "tenant": self.tenant,
                "owner": self.owner,
                "conversation_id": self.conversation_id,
                "turn_id": self.turn_id,
                "messages": [m.to_dict() for m in self.messages],
                "params": asdict(self.params),  # nested dataclasses become objects too
                "cache": self.cache,
                "cache_salt": self.cache_salt,
                "prompt": self.prompt_ids,
            },
            ensure_ascii=False,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> TurnRecord:
        d = json.loads(text)
        return cls(
            tenant=d["tenant"],
            owner=d["owner"],
            conversation_id=d["conversation_id"],
            turn_id=d["turn_id"],
            messages=[Message(m["role"], m["content"]) for m in d["messages"]],
            params=_params(d["params"]),
            cache=d["cache"],
            cache_salt=d["cache_salt"],
            prompt_ids=list(d["prompt"]),
        )


@dataclass
class JournalEntry:
    """A journaled turn in flight in this process."""

    entry_id: str
    record_key: str
    durable: bool = True  # False once a write was lost: the turn is not resumed later


@dataclass(frozen=True)
class RecoveredTurn:
    """A pending turn taken from the journal, as far as its record goes."""

    entry: JournalEntry
    record: TurnRecord
    texts: list[str]  # the token frames' texts, seq 0, 1, ...
    token_ids: list[int]  # the output token ids recorded
    start: tuple[int, ...] | None  # prompt, cached (and tier-cached) tokens of its start frame
    end: str | None  # its terminal frame, when it had finished (only the XACK was lost)
    ok: bool  # it finished with `done` (its reply belongs to the conversation)


def record_key(namespace: str, conversation_key: str, turn_id: str) -> str:
    """A turn's record: named by its conversation and id, so a late resume finds it."""
    digest = hashlib.sha256(f"{conversation_key}\x1f{turn_id}".encode()).hexdigest()[:32]
    return f"{namespace}:rec:{digest}"


def read_record(entry: JournalEntry, items: list[bytes]) -> RecoveredTurn:
    """A turn from its record's items. Raises ValueError, KeyError or TypeError when the
    record is not one of ours."""
    record = TurnRecord.from_json(items[0])
    texts: list[str] = []
    ids: list[int] = []
    start = None
    end = None
    ok = False
    for raw in items[1:]:
        item = json.loads(raw)
        ids += item.get("i", [])
        if "end" in item:
            end, ok = item["end"], bool(item["ok"])
            break
        if "start" in item and start is None:
            start = tuple(int(n) for n in item["start"][:3])
        if item["s"] != len(texts):
            raise ValueError(f"frame {item['s']} recorded out of order")
        texts.append(item["t"])
    return RecoveredTurn(entry, record, texts, ids, start, end, ok)


def _params(values: dict) -> SamplingParams:
    """SamplingParams back from their JSON (fields this version does not know are left out)."""
    known = {f.name for f in fields(SamplingParams)}
    kwargs = {k: v for k, v in values.items() if k in known}
    if isinstance(kwargs.get("response_format"), dict):
        kwargs["response_format"] = ResponseFormat(**kwargs["response_format"])
    return SamplingParams(**kwargs)
