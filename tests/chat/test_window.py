"""What a conversation keeps when it outgrows the window: whole turns after the system
prompt give way, a dropped prefix stays dropped, and a turn too long alone is refused."""

import pytest

from app.chat.prompt import Message
from app.chat.window import SLACK, HistoryTooLong, fit, reply_room


def render(messages):
    """One token per word, and one per message for its framing."""
    ids = []
    for m in messages:
        ids += [0] * (1 + len(m.content.split()))
    return ids


def history(turns, words=9, system=True):
    out = [Message("system", "be brief")] if system else []
    for i in range(turns):
        out.append(Message("user", f"q{i} " + "w " * (words - 1)))
        out.append(Message("assistant", f"a{i} " + "w " * (words - 1)))
    out.append(Message("user", "last question"))
    return out


def test_a_history_that_fits_is_kept_whole():
    h = history(3)
    w = fit(h, render, window=200, room=20, truncate=True)
    assert w.messages == h and w.dropped == 0 and w.drop is None
    assert w.prompt_ids == render(h)


def test_the_oldest_whole_turns_go_after_the_system_prompt_leaving_slack():
    h = history(10)  # 3 + 10 * 20 + 3 = 206 tokens
    w = fit(h, render, window=120, room=20, truncate=True)
    assert w.messages[0] == h[0]  # the system prompt stays
    assert w.messages[-1] == h[-1]  # the turn being answered stays
    assert w.messages[1].role == "user" and w.dropped % 2 == 0  # whole turns only
    assert w.messages == [h[0], *h[1 + w.dropped :]]
    assert len(w.prompt_ids) + 20 <= 120 - 120 // SLACK  # slack for the next turns
    # One turn fewer dropped would not have left the slack.
    assert len(render([h[0], *h[1 + w.dropped - 2 :]])) + 20 > 120 - 120 // SLACK


def test_a_dropped_prefix_stays_dropped_while_the_history_starts_the_same():
    h = history(10)
    first = fit(h, render, window=120, room=20, truncate=True)
    # The next turn is short: the fewest turns to drop would be fewer, but the model
    # must not see an old turn again (and the pinned prompt keeps its beginning).
    nxt = [*h, Message("assistant", "ok"), Message("user", "and?")]
    again = fit(nxt, render, window=120, room=20, truncate=True, remembered=first.drop)
    assert again.dropped == first.dropped
    assert again.messages[: len(first.messages)] == first.messages
    # An edited first question is another history: it starts over.
    edited = [h[0], Message("user", "another start"), *nxt[2:]]
    fresh = fit(edited, render, window=400, room=20, truncate=True, remembered=first.drop)
    assert fresh.dropped == 0


def test_without_truncation_or_room_it_is_refused():
    h = history(10)
    with pytest.raises(HistoryTooLong, match="tokens long"):
        fit(h, render, window=120, room=1, truncate=False)
    # Disabled truncation lets a prompt run that leaves at least one token.
    assert fit(history(2), render, window=50, room=1, truncate=False).dropped == 0
    huge = [Message("system", "s"), Message("user", "w " * 500)]
    with pytest.raises(HistoryTooLong, match="latest message is too long") as err:
        fit(huge, render, window=120, room=20, truncate=True)
    assert err.value.window == 120 and err.value.num_tokens > 120


def test_when_nothing_more_may_go_a_prompt_with_less_room_still_runs():
    h = [Message("user", "w " * 90)]  # 92 tokens, no turn to drop
    w = fit(h, render, window=100, room=20, truncate=True)
    assert w.messages == h and w.dropped == 0


def test_reply_room():
    assert reply_room(40, 256) == 40
    assert reply_room(4000, 256) == 64  # at most a quarter of the window
    assert reply_room(None, 256) == 32
