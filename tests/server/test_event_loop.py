"""Nothing slow runs on the event loop: while one socket's 1 MiB paste is tokenized,
another socket's reply keeps streaming. The tokenizer here blocks on a large text until
the other reply is complete: if tokenizing ran on the loop, that reply would never come."""

import asyncio
import json
import threading

import pytest
import websockets

from app.server import protocol as p
from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.server.fake_engine import FakeEngine


class BlockingTokenizer:
    """The real tokenizer, except that a large text waits for `release` first."""

    def __init__(self, tokenizer, large: int = 100_000) -> None:
        self._tokenizer = tokenizer
        self.large = large
        self.release = threading.Event()
        self.blocked = threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, text, *args, **kwargs):
        if len(text) > self.large:
            self.blocked.set()
            assert self.release.wait(60), "never released"
        return self._tokenizer.encode(text, *args, **kwargs)


def chat(turn_id: str, conversation: str, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return json.dumps(
        {"type": "chat", "id": turn_id, "conversation_id": conversation, "messages": messages}
    )


@pytest.mark.parametrize("history", ["a 1 MiB paste", "999 short messages"])
def test_a_large_history_does_not_stall_other_streams(tokenizer, history):
    # 999 messages of two characters each are few characters (the old measure of "large"),
    # and as much work for the chat template as a long text.
    blocking = BlockingTokenizer(tokenizer, 100_000 if history == "a 1 MiB paste" else 10_000)
    fake = FakeEngine(tokenizer, delay=0.01, reply=" ".join(["word"] * 30))
    fake.info = fake.info.__class__(fake.info.name, 10**7, fake.info.eos_token_ids, blocking)
    with live_server(create_app(engine=fake)) as s:
        url = s.url.replace("http", "ws") + "/ws"

        async def main():
            async with (
                websockets.connect(url, max_size=None) as paster,
                websockets.connect(url) as reader,
            ):
                if history == "a 1 MiB paste":
                    paste = "lorem ipsum " * ((p.MAX_FRAME_BYTES - 1000) // 12)
                    await paster.send(chat("big", "paste", paste))
                else:
                    roles = ("user", "assistant")
                    many = [{"role": roles[i % 2], "content": "hi"} for i in range(999)]
                    frame = {"type": "chat", "id": "big", "conversation_id": "paste"}
                    await paster.send(json.dumps({**frame, "messages": many}))
                await asyncio.to_thread(blocking.blocked.wait, 30)
                assert blocking.blocked.is_set(), "the paste never reached the tokenizer"
                await reader.send(chat("r", "other", "hi"))
                frames = []
                try:
                    while not frames or frames[-1]["type"] not in ("done", "error"):
                        frames.append(json.loads(await asyncio.wait_for(reader.recv(), 20)))
                finally:
                    blocking.release.set()
                assert frames[-1]["type"] == "done"
                assert sum(f["type"] == "token" for f in frames) == 30
                big = json.loads(await asyncio.wait_for(paster.recv(), 60))
                assert big["type"] == "start"  # the paste's turn goes on too

        asyncio.run(main())
