"""A fake engine behind EngineClient (AsyncEngine's surface): canned replies, fast
protocol tests. It follows the surface's every promise that a web test can see: n choices
told apart by index, logprobs when asked (made up: -0.5 each, top alternatives -1, -2, ...),
the prompt's logprobs on choice 0's first output, max_tokens 0 for scoring."""

from __future__ import annotations

import asyncio
import time

from app.engine.engine_request import EngineRequest
from app.engine.errors import ContextTooLong, EngineDead
from app.engine.logprobs import Logprob
from app.engine.outputs import EngineStats, ModelInfo, RequestOutput
from app.engine.request import FinishReason, SamplingParams, Timings


class FakeEngine:
    """Replies with the words of `reply` (default: echoes the prompt's length), one word
    per output every `delay` seconds. Records what it was asked, for assertions."""

    def __init__(self, tokenizer, delay: float = 0.001, reply: str | None = None) -> None:
        self.info = ModelInfo("fake", 2048, frozenset({tokenizer.eos_token_id}), tokenizer)
        self.tokenizer = tokenizer
        self.delay = delay
        self.reply = reply
        self.running = False
        self.live: set[str] = set()
        self.aborted: set[str] = set()
        self.released: list[str] = []
        self.sessions: dict[str, str | None] = {}  # request id -> session id
        self.prefix_cache: dict[str, bool] = {}
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.salts: dict[str, str | None] = {}
        self.listeners: list = []

    def start(self) -> None:
        self.running = True

    async def stop(self) -> None:
        self.running = False

    def healthy(self) -> bool:
        return self.running

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def release_session(self, session_id: str) -> None:
        self.released.append(session_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.live),
            num_waiting=0,
            kv_usage=0.0,
            num_free_blocks=0,
            num_blocks=0,
            num_preemptions=0,
            prefix_queries=0,
            prefix_hits=0,
            pin_hits=0,
            sessions_pinned=0,
            pinned_blocks=0,
            session_unpins={},
            steps=0,
        )

    async def generate(self, asked: EngineRequest):
        prompt, params, request_id = asked.prompt, asked.params, asked.request_id
        if not self.running:
            raise EngineDead("the engine is not running")
        limit = self.info.max_model_len
        if len(prompt) >= limit:
            raise ContextTooLong("the prompt is too long for the context", len(prompt), limit)
        self.live.add(request_id)
        self.salts[request_id] = asked.cache_salt
        self.sessions[request_id] = asked.session_id
        self.prefix_cache[request_id] = asked.use_prefix_cache
        self.prompts[request_id] = list(prompt)
        self.params[request_id] = params
        words = (self.reply or f"reply to {len(prompt)} tokens").split(" ")
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        timings = Timings()
        scored = None
        if params.prompt_logprobs is not None:
            scored = [None] + [self._logprob(t, params.prompt_logprobs) for t in prompt[1:]]
        if params.max_tokens == 0:
            yield self._out(request_id, prompt, "", 0, True, FinishReason.LENGTH, timings,
                            0, None, scored)  # fmt: skip
            self.live.discard(request_id)
            return
        counts = [0] * params.n
        try:
            for i, word in enumerate(words[: params.max_tokens]):
                await asyncio.sleep(self.delay)
                if request_id in self.aborted:
                    break
                timings.first_token = timings.first_token or time.monotonic()
                last = i == len(words) - 1 or i + 1 == params.max_tokens
                if last:
                    timings.finished = time.monotonic()
                for index in range(params.n):
                    counts[index] += 1
                    yield self._out(
                        request_id,
                        prompt,
                        word if i == 0 else " " + word,
                        counts[index],
                        last,
                        FinishReason.STOP if last else None,
                        timings,
                        index,
                        params.logprobs,
                        scored if i == 0 and index == 0 else None,
                    )
                if last:
                    return
            timings.finished = time.monotonic()
            for index in range(params.n):
                yield self._out(request_id, prompt, "", counts[index], True, FinishReason.ABORT,
                                timings, index)  # fmt: skip
        finally:
            self.live.discard(request_id)

    @staticmethod
    def _logprob(token_id: int, k: int) -> Logprob:
        return Logprob(token_id, -0.5, tuple((token_id + j, -1.0 - j) for j in range(k)))

    def _out(self, rid, prompt, text, n, finished, reason, timings, index=0, logprobs=None,
             scored=None) -> RequestOutput:  # fmt: skip
        ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        lps = None if logprobs is None else [self._logprob(t, logprobs) for t in ids]
        return RequestOutput(rid, text, ids, finished, reason, len(prompt), 0, n, timings,
                             index, lps, scored)  # fmt: skip
