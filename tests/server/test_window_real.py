"""A conversation past the model's window with the real model: on /ws the oldest turns
give way (the start frame says how many messages), each reply equals a fresh conversation's
with the truncated history, the pinned K/V is reused by the next turn, and `continue`
goes on with a reply cut at its length limit as if it had never stopped. On /v1 the
default stays OpenAI's context_length_exceeded; truncation "auto" drops turns there too."""

import itertools

import openai
import pytest
from starlette.testclient import TestClient

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.engine import LLMEngine
from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.server.test_ws_fake import text_of, until_terminal
from tests.server.test_ws_real import Recording
from tests.server.testclient import for_testclient

WINDOW = 256
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
QUESTIONS = [
    "Name a large city in France.",
    "What river runs through it?",
    "Name a famous museum there.",
    "What is a well known dish of that country?",
    "Which mountains lie on its border with Spain?",
    "Name a French painter.",
    "What is the capital of Italy?",
    "And of Spain?",
]


@pytest.fixture
def engine(smollm):  # one a test: an app's lifespan stops its engine for good
    config = EngineConfig(model=ModelConfig(max_model_len=WINDOW), cache=CacheConfig(64 << 20))
    return Recording(LLMEngine(config, smollm))


def say(ws, id, conversation, messages, max_tokens=40, **extra):
    ws.send_json(
        {
            "type": "chat",
            "id": id,
            "conversation_id": conversation,
            "messages": messages,
            "params": {"temperature": 0, "max_tokens": max_tokens},
            **extra,
        }
    )
    return until_terminal(ws, [id])[id]


def served(engine) -> TestClient:
    return TestClient(create_app(server_config=for_testclient(), engine=engine))


def test_a_conversation_past_the_window_drops_old_turns_consistently(engine):
    messages = [SYSTEM]
    turns = []  # (dropped, cached_tokens, prompt + completion tokens) per turn
    with (
        TestClient(create_app(server_config=for_testclient(), engine=engine)) as client,
        client.websocket_connect("/ws") as ws,
    ):
        for i, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            frames = say(ws, f"t{i}", "long", messages)
            start, done = frames[0], frames[-1]
            assert done["type"] == "done", done
            assert start["prompt_tokens"] + done["usage"]["completion_tokens"] <= WINDOW
            reply = text_of(frames)
            dropped = start["dropped_messages"]
            if dropped:
                # What the model saw: the system prompt and the turns after the dropped ones.
                seen = [SYSTEM, *messages[1 + dropped :]]
                assert seen[1]["role"] == "user"
                prompt = engine.prompts[-1]
                fresh = say(ws, f"f{i}", f"fresh{i}", seen, cache=False)
                assert fresh[0]["dropped_messages"] == 0
                assert engine.prompts[-1] == prompt  # the same prompt, computed anew
                assert text_of(fresh) == reply  # the pinned K/V is what the model saw
            total = done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]
            turns.append((dropped, start["cached_tokens"], total))
            messages.append({"role": "assistant", "content": reply})
    assert any(d for d, _, _ in turns), "the conversation never outgrew the window"
    # A turn that drops what the one before it dropped starts as that one did: it reuses
    # the pinned K/V (prompt and reply) of the turn before.
    same = [(b, a) for a, b in itertools.pairwise(turns) if b[0] == a[0] and a[0] > 0]
    assert same, turns
    for (_, cached, _), (_, _, previous_total) in same:
        assert cached >= previous_total - 4


def test_disabled_truncation_keeps_the_error_on_ws(engine):
    messages = [SYSTEM]
    for q in QUESTIONS:
        messages += [{"role": "user", "content": q * 3}, {"role": "assistant", "content": q * 3}]
    messages.append({"role": "user", "content": "And?"})
    with (
        TestClient(create_app(server_config=for_testclient(), engine=engine)) as client,
        client.websocket_connect("/ws") as ws,
    ):
        frames = say(ws, "x", "c", messages, truncation="disabled")
        assert frames[-1]["type"] == "error"
        assert frames[-1]["code"] == "context_length_exceeded"
        ok = say(ws, "y", "d", messages)
        assert ok[-1]["type"] == "done", ok[-1]
        assert ok[0]["dropped_messages"] > 0


def test_continue_goes_on_as_if_the_reply_had_not_stopped(engine):
    # A question whose greedy reply runs past 30 tokens, so that both cuts are by length.
    # ("Count from one to twenty in words." stopped after 8 once the attention's V sums
    # became fused multiply-adds: a near tie fell the other way.)
    question = "List the days of the week, then the months of the year."
    ask = [SYSTEM, {"role": "user", "content": question}]
    with (
        TestClient(create_app(server_config=for_testclient(), engine=engine)) as client,
        client.websocket_connect("/ws") as ws,
    ):
        whole_frames = say(ws, "w", "whole", ask, max_tokens=30)
        assert whole_frames[-1]["finish_reason"] == "length"
        whole = text_of(whole_frames)
        cut_frames = say(ws, "c", "cut", ask, max_tokens=12)
        assert cut_frames[-1]["finish_reason"] == "length"
        cut = text_of(cut_frames)
        more = say(ws, "m", "cut", [*ask, {"role": "assistant", "content": cut}],
                   max_tokens=18, **{"continue": True})  # fmt: skip
        assert more[-1]["type"] == "done"
        assert more[0]["cached_tokens"] > 0  # the cut reply's K/V, pinned
        assert cut + text_of(more) == whole
        bad = say(ws, "b", "cut", ask, **{"continue": True})
        assert bad[-1]["code"] == "bad_request"


def test_v1_keeps_openais_error_and_truncates_when_asked(engine):
    messages = [SYSTEM]
    for q in QUESTIONS:
        messages += [{"role": "user", "content": q * 3}, {"role": "assistant", "content": q * 3}]
    messages.append({"role": "user", "content": "And?"})
    with live_server(create_app(engine=engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=engine.info.name, messages=messages, max_tokens=8)
        assert err.value.code == "context_length_exceeded"
        raw = client.chat.completions.with_raw_response.create(
            messages=messages, model=engine.info.name, max_tokens=8, temperature=0,
            extra_body={"truncation": "auto"},
        )  # fmt: skip
        dropped = int(raw.headers["x-parley-truncated-messages"])
        assert dropped > 0 and dropped % 2 == 0
        reply = raw.parse().choices[0].message.content
        kept = [SYSTEM, *messages[1 + dropped :]]
        fresh = client.chat.completions.create(
            messages=kept, model=engine.info.name, max_tokens=8, temperature=0
        )
        assert fresh.choices[0].message.content == reply
