"""What the journal keeps of a turn (app.server.journal), and how it reads back.

A turn's record is a Redis list: its header (a TurnRecord as JSON: who, which
conversation, the history, the prompt's token ids, the sampling parameters), then one item
per token frame sent, `{"s": seq, "t": text, "i": [token ids since the last item]}` (the
first with `"start": [prompt_tokens, cached_tokens, tier_cached_tokens]`), then its end,
`{"end": terminal frame, "ok": bool, "i": [...]}`. A record is named by its conversation
and turn id, so a resume after a restart can find a finished turn's record without the
stream entry. The header also carries the nonce of the accept that wrote it (`n`), so an
accept whose answer was lost can be told from a later one of the same turn id.

Anything may be in Redis under these names (another program's keys, a half-written record,
a later version's): read_record checks every field's type and raises BadRecord, a
ValueError, for anything it cannot take as a turn.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from app.chat.prompt import ROLES, Message
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
    nonce: str = ""  # of the accept that wrote it (read back; written by to_json(nonce))

    def to_json(self, nonce: str = "") -> str:
        return json.dumps(
            {
                "v": VERSION,
                "n": nonce,
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
        """Raises BadRecord when `text` is not a header this version can take."""
        d = _object(_json(text), "the header")
        messages = _list(d, "messages")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES + ("tool",):
                raise BadRecord("a message is not {role, content}")
        try:
            params = _params(_object(d.get("params"), "params"))
        except (ValueError, TypeError) as exc:  # BadParameter is a ValueError
            raise BadRecord(f"params: {exc}") from None
        return cls(
            tenant=_str(d, "tenant"),
            owner=_str(d, "owner"),
            conversation_id=_str(d, "conversation_id"),
            turn_id=_str(d, "turn_id"),
            messages=[Message(m["role"], _str(m, "content")) for m in messages],
            params=params,
            cache=_bool(d, "cache"),
            cache_salt=None if d.get("cache_salt") is None else _str(d, "cache_salt"),
            prompt_ids=_ids(d, "prompt"),
            nonce=d["n"] if isinstance(d.get("n"), str) else "",
        )


class BadRecord(ValueError):
    """A record (or a part of one) that is not a turn of ours."""


@dataclass
class JournalEntry:
    """A journaled turn in flight in this process."""

    entry_id: str
    record_key: str
    durable: bool = True  # False once a write was lost: the turn is not resumed later
    lost: bool = False  # another process took it over (this one stalled): it stops here
    items: int = 1  # the record's length as this process wrote it (the header: 1)
    nonce: str = ""  # of the accept that added it
    abandoned: bool = False  # not durable, and to be acknowledged once Redis answers
    released: bool = False  # a write failed: stopped here, taken up again from its record

    @property
    def taken_over(self) -> bool:
        """The turn stops here and goes on from its record: another process took it over
        (`lost`), or a write failed for too long (`released`)."""
        return self.lost or self.released


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
    """A turn from its record's items. Raises BadRecord when the record is not one of ours
    or not whole."""
    record = TurnRecord.from_json(items[0])
    texts: list[str] = []
    ids: list[int] = []
    start = None
    end = None
    ok = False
    for raw in items[1:]:
        item = _object(_json(raw), "a frame")
        ids += _ids(item, "i") if "i" in item else []
        if "end" in item:
            if item["end"] is not None and not isinstance(item["end"], str):
                raise BadRecord("the end is not a frame")
            end, ok = item["end"], _bool(item, "ok")
            break
        if "start" in item and start is None:
            start = tuple(_ids(item, "start")[:3])
        if item.get("s") != len(texts) or isinstance(item.get("s"), bool):
            raise BadRecord(f"frame {item.get('s')!r} recorded out of order")
        texts.append(_str(item, "t"))
    return RecoveredTurn(entry, record, texts, ids, start, end, ok)


def _json(raw: str | bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRecord(f"not JSON: {exc}") from None


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise BadRecord(f"{what} is not an object")
    return value


def _str(d: dict, key: str) -> str:
    if not isinstance(d.get(key), str):
        raise BadRecord(f"{key!r} is not a string")
    return d[key]


def _bool(d: dict, key: str) -> bool:
    if not isinstance(d.get(key), bool):
        raise BadRecord(f"{key!r} is not true or false")
    return d[key]


def _list(d: dict, key: str) -> list:
    if not isinstance(d.get(key), list):
        raise BadRecord(f"{key!r} is not a list")
    return d[key]


def _ids(d: dict, key: str) -> list[int]:
    ids = _list(d, key)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in ids):
        raise BadRecord(f"{key!r} holds something other than token ids")
    return ids


def _params(values: dict) -> SamplingParams:
    """SamplingParams back from their JSON (fields this version does not know are left out)."""
    known = {f.name for f in fields(SamplingParams)}
    kwargs = {k: v for k, v in values.items() if k in known}
    if isinstance(kwargs.get("response_format"), dict):
        kwargs["response_format"] = ResponseFormat(**kwargs["response_format"])
    return SamplingParams(**kwargs)
