"""A journaled turn's continuation (turn_runner.continuation): the engine's Continuation
of its recorded output, cut back to the text its clients were sent."""

from pathlib import Path

from app.chat.prompt import Message
from app.engine import continuation as continuation_module
from app.engine.request import SamplingParams
from app.server.journal_records import JournalEntry, RecoveredTurn, TurnRecord
from app.server.turn_runner import continuation

ESSAY = (Path(__file__).parent.parent / "data" / "essays.txt").read_text()


def recovered(ids: list[int], texts: list[str], params: SamplingParams) -> RecoveredTurn:
    record = TurnRecord("t", "o", "c1", "turn1", [Message("user", "hi")], params, True, None,
                        [1, 2, 3])  # fmt: skip
    return RecoveredTurn(JournalEntry("1-0", "rec"), record, texts, ids, (3, 2), None, False)


def test_a_recorded_reply_is_replayed_from_its_record(tokenizer):
    ids = tokenizer.encode(ESSAY[:200], add_special_tokens=False)
    texts = [tokenizer.decode(ids[:9]), tokenizer.decode(ids)[len(tokenizer.decode(ids[:9])) :]]
    resumed = continuation(tokenizer, recovered(ids, texts, SamplingParams(max_tokens=300)))
    assert resumed.text == "".join(texts)
    assert resumed.cont.replays and resumed.cont.kept_ids == tuple(ids)
    assert resumed.cont.prompt_ids == (1, 2, 3)
    spent = SamplingParams(max_tokens=len(ids))
    assert continuation(tokenizer, recovered(ids, texts, spent)) is None


def test_a_prefilled_turn_skips_the_special_tokens_as_its_reply_did(tokenizer, monkeypatch):
    monkeypatch.setattr(continuation_module, "REPLAY_MAX_TOKENS", 0)
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    text = tokenizer.decode(ids)  # what clients saw: the special token's text skipped
    resumed = continuation(tokenizer, recovered([*ids, eos], [text], SamplingParams()))
    assert resumed.cont.kept_ids == (*ids, eos) and resumed.cont.skip == 0
    shown = SamplingParams(skip_special_tokens=False)
    resumed = continuation(tokenizer, recovered([*ids, eos], [text], shown))
    assert resumed.cont.kept_ids == tuple(ids)  # its text was not sent: made again
