"""Where a turn taken from the journal picks up (turn_runner.continuation), alone: the
replay-or-prefill choice, the cut back to text the clients had, the budget and the seed."""

from pathlib import Path

from app.chat.prompt import Message
from app.engine.request import REPLAY_MAX_TOKENS, SamplingParams
from app.server.journal_records import JournalEntry, RecoveredTurn, TurnRecord
from app.server.turn_runner import continuation

ESSAY = (Path(__file__).parent.parent / "data" / "essays.txt").read_text()


def recovered(ids: list[int], texts: list[str], params: SamplingParams) -> RecoveredTurn:
    record = TurnRecord("t", "o", "c1", "turn1", [Message("user", "hi")], params, True, None,
                        [1, 2, 3])  # fmt: skip
    return RecoveredTurn(JournalEntry("1-0", "rec"), record, texts, ids, (3, 2), None, False)


def test_a_short_reply_is_replayed_whole(tokenizer):
    ids = tokenizer.encode(ESSAY[:200], add_special_tokens=False)
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=300)
    cont = continuation(tokenizer, recovered(ids, [tokenizer.decode(ids)], params))
    assert cont.replays and cont.params.replay_ids == tuple(ids)
    assert cont.token_ids == ids and cont.skip == 0 and cont.prompt_ids == [1, 2, 3]
    assert cont.params.max_tokens == 300 and cont.params.seed_offset == 0  # replay counts
    assert cont.start == (3, 2)


def test_a_spent_budget_has_no_continuation(tokenizer):
    ids = tokenizer.encode(ESSAY[:200], add_special_tokens=False)
    text = tokenizer.decode(ids)
    one_left = SamplingParams(max_tokens=len(ids) + 1)
    assert continuation(tokenizer, recovered(ids, [text], one_left)) is not None
    spent = SamplingParams(max_tokens=len(ids))
    assert continuation(tokenizer, recovered(ids, [text], spent)) is None


def test_a_long_reply_is_cut_back_to_the_text_the_clients_had(tokenizer):
    ids = tokenizer.encode(ESSAY, add_special_tokens=False)[: REPLAY_MAX_TOKENS + 40]
    whole = tokenizer.decode(ids)
    sent = whole[:-7]  # the last characters held back (a possible stop string)
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=2000)
    cont = continuation(tokenizer, recovered(ids, [sent[:100], sent[100:]], params))
    keep = len(cont.token_ids)
    assert not cont.replays and 0 < keep < len(ids) and cont.token_ids == ids[:keep]
    decoded = tokenizer.decode(ids[:keep])
    assert sent.startswith(decoded)  # every kept token's text was sent...
    assert not sent.startswith(tokenizer.decode(ids[: keep + 1]))  # ...and no more
    assert cont.text == sent and cont.skip == len(sent) - len(decoded)  # sent again: skipped
    assert cont.params.max_tokens == 2000 - keep and cont.params.seed_offset == keep


def test_a_long_reply_with_logprobs_is_never_replayed(tokenizer):
    ids = tokenizer.encode(ESSAY[:200], add_special_tokens=False)
    params = SamplingParams(max_tokens=300, logprobs=2)
    cont = continuation(tokenizer, recovered(ids, [tokenizer.decode(ids)], params))
    assert not cont.replays and cont.token_ids == ids and cont.skip == 0
    assert cont.params.max_tokens == 300 - len(ids)
