"""/ws with the real model: multi-turn reuse, many sockets, a clean pool, KV pressure."""

import contextlib
import threading
import time

import pytest
from starlette.testclient import TestClient

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.model.build import choose_format
from app.server.app import create_app
from tests.engine.util import all_free, held_back_by, run
from tests.server.test_ws_fake import until_terminal
from tests.server.testclient import for_testclient


class Recording(AsyncEngine):
    """An AsyncEngine that remembers each turn's prompt ids (to replay them uncached)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.prompts: list[list[int]] = []

    async def generate(self, asked):
        self.prompts.append(list(asked.prompt))
        async for out in super().generate(asked):
            yield out


def make(smollm, kv_bytes=128 << 20):
    engine = Recording(LLMEngine(EngineConfig(cache=CacheConfig(kv_bytes)), smollm))
    return engine, TestClient(create_app(engine=engine, server_config=for_testclient()))


@pytest.fixture(scope="module")
def uncached(smollm):
    engine = LLMEngine(
        EngineConfig(cache=CacheConfig(64 << 20, enable_prefix_caching=False)), smollm
    )

    def reply(prompt, max_tokens):
        engine.add_request(
            EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), "x")
        )
        return run(engine)["x"].text

    return reply


def wait_all_free(engine, timeout=5.0):
    """The engine thread applies releases between steps: give it a moment."""
    deadline = time.monotonic() + timeout
    while not all_free(engine) and time.monotonic() < deadline:
        time.sleep(0.01)
    return all_free(engine)


def say(ws, id, conversation, messages, max_tokens=24):
    ws.send_json(
        {
            "type": "chat",
            "id": id,
            "conversation_id": conversation,
            "messages": messages,
            "params": {"temperature": 0, "max_tokens": max_tokens},
        }
    )


def text_of(frames):
    return "".join(f["text"] for f in frames if f["type"] == "token")


def test_four_turns_reuse_the_previous_turn_and_match_uncached(smollm, uncached):
    engine, client = make(smollm)
    questions = [
        "Name a large city in France.",
        "What river runs through it?",
        "Is it long?",
        "Thanks! One more fact, please.",
    ]
    messages = []
    previous_total = None
    with client, client.websocket_connect("/ws") as ws:
        for i, q in enumerate(questions):
            messages.append({"role": "user", "content": q})
            say(ws, f"t{i}", "conv", messages)
            frames = until_terminal(ws, [f"t{i}"])[f"t{i}"]
            start, done = frames[0], frames[-1]
            assert start["type"] == "start" and done["type"] == "done"
            reply = text_of(frames)
            assert reply == uncached(engine.prompts[-1], 24)
            if previous_total is not None:
                assert start["cached_tokens"] >= previous_total - 4
                assert done["usage"]["cached_tokens"] == start["cached_tokens"]
            previous_total = done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]
            messages.append({"role": "assistant", "content": reply})
        ws.send_json({"type": "delete", "conversation_id": "conv"})
        assert ws.receive_json()["type"] == "deleted"
        assert wait_all_free(engine.engine)
    # The lifespan stopped the engine: no loop thread is left behind.
    assert not any(t.name == "parley-engine" for t in threading.enumerate())


def test_stream_interval_sends_several_tokens_a_frame(smollm, uncached):
    """--stream-interval 4: the first token frame at once, then frames of 4 tokens (the
    last of what is left); the reply is the one sent token by token."""
    engine, client = make(smollm)
    engine.stream_interval = 4
    with client, client.websocket_connect("/ws") as ws:
        say(ws, "t0", "conv", [{"role": "user", "content": "Name a city."}], max_tokens=14)
        frames = until_terminal(ws, ["t0"])["t0"]
    tokens = [f for f in frames if f["type"] == "token"]
    assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == 14
    counts = [f["completion_tokens"] for f in tokens]  # [1, 5, 9, 13, 14], frames unmerged
    assert held_back_by([b - a for a, b in zip([0, *counts], counts)], 4, 14), counts
    assert text_of(frames) == uncached(engine.prompts[-1], 14)


def test_two_conversations_per_socket_and_ten_sockets(smollm, uncached):
    engine, client = make(smollm)
    prompts = [f"Write one sentence about the number {n}." for n in range(12)]
    with client, contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(client.websocket_connect("/ws")) for _ in range(10)]
        # Socket 0 carries two conversations; the others one each: 11 turns at once.
        plan = [(0, "a0", "c0", prompts[0]), (0, "a1", "c1", prompts[1])]
        plan += [(k, f"b{k}", f"d{k}", prompts[k + 1]) for k in range(1, 10)]
        for k, tid, conv, text in plan:
            say(sockets[k], tid, conv, [{"role": "user", "content": text}], max_tokens=16)
        results = {}
        for k in range(10):
            ids = [tid for kk, tid, _, _ in plan if kk == k]
            results.update(until_terminal(sockets[k], ids))
        for _k, tid, _conv, text in plan:
            frames = results[tid]
            assert [f["type"] for f in frames].count("done") == 1
            prompt = list(
                smollm.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    add_generation_prompt=True,
                    return_dict=False,
                )
            )
            assert text_of(frames) == uncached(prompt, 16)
        for k, _tid, conv, _ in plan:
            sockets[k].send_json({"type": "delete", "conversation_id": conv})
            assert sockets[k].receive_json()["type"] == "deleted"
        for ws in sockets:
            ws.close()
        assert wait_all_free(engine.engine)
    engine.engine.check_integrity()


def test_kv_pressure_unpins_oldest_idle_sessions_and_turns_finish(smollm):
    # 64 blocks of 16 tokens; twelve idle conversations pin ~40, the long turn needs ~45.
    kv_dtype = choose_format(ModelConfig(), smollm, "cpu").torch_dtype  # K/V follow activations
    per_block = 2 * smollm.arch.num_layers * 16 * smollm.arch.kv_size * kv_dtype.itemsize
    engine, client = make(smollm, kv_bytes=65 * per_block)
    with client, client.websocket_connect("/ws") as ws:
        for i in range(12):
            say(ws, f"s{i}", f"conv{i}", [{"role": "user", "content": f"Say hi to {i}."}], 12)
            assert until_terminal(ws, [f"s{i}"])[f"s{i}"][-1]["type"] == "done"
        pinned_before = engine.engine.stats().sessions_pinned
        assert pinned_before == 12
        long_text = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 60
        say(ws, "big", "bigconv", [{"role": "user", "content": long_text}], 48)
        frames = until_terminal(ws, ["big"])["big"]
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] in ("stop", "length")
    stats = engine.engine.stats()
    assert stats.session_unpins.get("pressure", 0) > 0
    kept = [f"conv{i}" for i in range(12) if f"conv{i}" in engine.engine.kv.pins]
    assert kept == [f"conv{i}" for i in range(12 - len(kept), 12)]  # oldest went first
