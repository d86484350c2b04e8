"""Session pins on a tiny model: a conversation keeps its K/V between turns."""

import random

from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from tests.engine.util import all_free, run
from tests.tiny import tiny_engine

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def turn(engine, rid, prompt, session="s", params=PARAMS):
    engine.add_request(EngineRequest(prompt, params, rid, session_id=session))
    return run(engine)[rid]


def uncached(tokenizer, prompt, params=PARAMS):
    engine = tiny_engine(tokenizer, prefix_caching=False)
    engine.add_request(EngineRequest(prompt, params, "x"))
    return run(engine)["x"].token_ids


def test_next_turn_reuses_prompt_and_reply_to_the_token(tokenizer):
    engine = tiny_engine(tokenizer, prefix_caching=False)  # pins alone
    history = tokens(37, 0)  # not block aligned: the pin ends inside a block
    previous = 0
    for t in range(4):
        r = turn(engine, f"t{t}", history)
        assert r.token_ids == uncached(tokenizer, history)
        if t:
            # Everything computed last turn: its prompt and reply but the last token.
            assert r.cached_tokens == previous - 1
        history = history + r.token_ids + tokens(9, t + 1)
        previous = len(history) - 9
    assert engine.stats().sessions_pinned == 1


def test_edit_and_regenerate_are_a_shorter_common_prefix(tokenizer):
    engine = tiny_engine(tokenizer)
    first = tokens(50, 0)
    r1 = turn(engine, "a", first)
    # Regenerate: the same prompt again. Its last token must be recomputed, and it lies
    # in a block the reply filled (full, hashed, shared): reuse stops at that block.
    regen = turn(engine, "b", first)
    assert regen.cached_tokens == 48 and regen.token_ids == r1.token_ids
    edited = first[:21] + tokens(12, 9)  # cut inside a full, hashed block
    r3 = turn(engine, "c", edited)
    assert r3.cached_tokens == 16  # back to the block boundary: the hashed block is shared
    assert r3.token_ids == uncached(tokenizer, edited)


def test_cancelled_turn_pins_what_it_computed(tokenizer):
    engine = tiny_engine(tokenizer)
    prompt = tokens(40, 0)
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    engine.add_request(EngineRequest(prompt, params, "a", session_id="s"))

    def cancel_at_step_6(i):
        if i == 6:
            engine.abort("a")

    out = run(engine, before_step=cancel_at_step_6)["a"]
    assert out.finish_reason == "abort"
    pinned = engine.kv.pins.pinned_tokens("s")
    assert pinned == (prompt + out.token_ids)[: len(pinned)] and len(pinned) >= len(prompt)


def test_released_and_expired_pins_free_their_blocks(tokenizer):
    engine = tiny_engine(tokenizer)
    for s in ("a", "b"):
        turn(engine, s, tokens(40, ord(s)), session=s)
    assert engine.stats().pinned_blocks > 0 and not all_free(engine)
    assert engine.release_session("a") and not engine.release_session("a")
    assert engine.kv.pins.expire(ttl_s=0.0) == 1
    assert all_free(engine)
    assert engine.stats().session_unpins == {"released": 1, "ttl": 1}
    engine.check_integrity()


def test_pressure_unpins_oldest_idle_sessions_first(tokenizer):
    # 40 usable blocks; each session pins 4 (40 prompt + 20 reply tokens).
    engine = tiny_engine(tokenizer, num_blocks=41)
    for i in range(9):
        turn(engine, f"r{i}", tokens(40, i), session=f"s{i}")
    assert engine.stats().sessions_pinned == 9
    # Two big requests need ~24 blocks: the oldest sessions go, in order.
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request(EngineRequest(tokens(120, 100), params, "big1"))
    engine.add_request(EngineRequest(tokens(120, 101), params, "big2"))
    res = run(engine)
    assert res["big1"].finish_reason == res["big2"].finish_reason == "length"
    left = [f"s{i}" for i in range(9) if f"s{i}" in engine.kv.pins]
    assert left == [f"s{i}" for i in range(9 - len(left), 9)]  # the newest survived
    assert engine.stats().session_unpins["pressure"] == 9 - len(left) > 0
    assert engine.scheduler.stats.num_preemptions == 0  # pins went before running work


def test_a_queued_turn_keeps_its_pin_longer_than_idle_sessions(tokenizer):
    engine = tiny_engine(tokenizer, num_blocks=21, max_num_seqs=1)  # 20 usable blocks
    history = tokens(40, 0)
    r = turn(engine, "t0", history, session="queued")  # older pin: 4 blocks
    turn(engine, "i0", tokens(40, 1), session="idle")  # newer pin: 4 blocks
    params = SamplingParams(temperature=0, max_tokens=140, ignore_eos=True)
    engine.add_request(EngineRequest(tokens(60, 5), params, "hog"))  # 13 blocks: one pin must go
    follow_up = history + r.token_ids + tokens(5, 1)
    engine.add_request(
        EngineRequest(follow_up, PARAMS, "t1", session_id="queued")
    )  # waits behind hog
    res = run(engine)
    assert "idle" not in engine.kv.pins  # the newer but idle session lost its pin
    assert res["t1"].cached_tokens == len(history) + len(r.token_ids) - 1


def test_pins_never_deadlock_the_queue(tokenizer):
    engine = tiny_engine(tokenizer, num_blocks=21, max_num_seqs=1)
    history = tokens(40, 0)
    r = turn(engine, "t0", history, session="queued")
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    engine.add_request(
        EngineRequest(tokens(60, 5), params, "hog")
    )  # needs all 20 blocks at the end
    engine.add_request(
        EngineRequest(history + r.token_ids + tokens(5, 1), PARAMS, "t1", session_id="queued")
    )
    res = run(engine, max_steps=2000)
    assert res["hog"].finish_reason == res["t1"].finish_reason == "length"
    assert res["t1"].token_ids == uncached(tokenizer, history + r.token_ids + tokens(5, 1))
