"""AsyncEngine: streaming, abort on cancel or early exit, coalescing, errors."""

import asyncio

import pytest

from app.config import EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine_request import EngineRequest
from app.engine.errors import EngineDead
from app.engine.request import SamplingParams
from tests.engine.util import all_free, held_back_by
from tests.tiny import tiny_engine

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


async def collect(engine: AsyncEngine, prompt, params=PARAMS, request_id=None):
    outs = [o async for o in engine.generate(EngineRequest(prompt, params, request_id))]
    return outs


@pytest.fixture
def aengine(tokenizer):
    engine = AsyncEngine(tiny_engine(tokenizer))
    engine.start()
    yield engine
    asyncio.run(engine.stop())


async def wait_until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


def test_streams_equal_the_synchronous_engine(tokenizer, aengine):
    prompts = [[100 + i, 200 + i, 300 + i, 400] for i in range(5)]
    sync = tiny_engine(tokenizer)
    expected = []
    for p in prompts:
        sync.add_request(EngineRequest(p, PARAMS, "x"))
        tokens = []
        while sync.has_unfinished_requests():
            for o in sync.step():
                tokens += o.new_token_ids
        expected.append(tokens)

    async def main():
        return await asyncio.gather(*(collect(aengine, p) for p in prompts))

    results = asyncio.run(main())
    for outs, exp in zip(results, expected):
        assert [t for o in outs for t in o.new_token_ids] == exp
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 20
    assert all_free(aengine.engine)


def test_breaking_out_of_the_stream_aborts_and_frees(aengine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        async for out in aengine.generate(EngineRequest([5, 6, 7], params, "long")):
            if out.completion_tokens >= 3:
                break
        await wait_until(lambda: not aengine.engine.requests)

    asyncio.run(main())
    assert all_free(aengine.engine)


def test_abort_ends_the_stream_with_abort(aengine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        outs = []
        async for out in aengine.generate(EngineRequest([5, 6, 7], params, "x")):
            outs.append(out)
            if len(outs) == 2:
                aengine.abort("x")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert all_free(aengine.engine)


def test_an_abort_while_the_request_is_prepared_is_not_lost(aengine):
    """A long prompt is tokenized off the loop before it is queued: an abort that comes
    meanwhile follows the request in, instead of reaching the engine first and missing."""

    async def main():
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        prompt = "hello " * 1500  # over INLINE_TEXT_CHARS: tokenized on a thread
        outs = []
        stream = aengine.generate(EngineRequest(prompt, params, "early"))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # generate() has begun and is tokenizing
        assert "early" in aengine._preparing
        aengine.abort("early")
        outs.append(await asyncio.wait_for(first, 60))
        outs += [o async for o in stream]
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert sum(len(o.new_token_ids) for o in outs) < 10_000
    assert all_free(aengine.engine) and not aengine._preparing


def test_cancelled_task_aborts(aengine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        task = asyncio.create_task(collect(aengine, [5, 6, 7], params, "c"))
        await wait_until(lambda: "c" in aengine.engine.requests)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: not aengine.engine.requests)

    asyncio.run(main())
    assert all_free(aengine.engine)


def test_slow_reader_gets_merged_outputs(aengine):
    async def main():
        outs = []
        async for out in aengine.generate(EngineRequest([5, 6, 7], PARAMS)):
            outs.append(out)
            await asyncio.sleep(0.2)  # much slower than the tiny model
        return outs

    outs = asyncio.run(main())
    assert sum(len(o.new_token_ids) for o in outs) == 20
    assert len(outs) < 20  # some outputs carried several tokens


def test_stream_interval_hands_out_every_n_tokens(aengine):
    """With a stream interval of 4, each choice's outputs carry 1 token (the first, at
    once), then 4 at a time, then what is left with the last; the tokens are those of
    the same request streamed token by token."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)

    def by_choice(outs):
        return {i: [o for o in outs if o.index == i] for i in (0, 1)}

    each = by_choice(asyncio.run(collect(aengine, [5, 6, 7], params)))
    aengine.stream_interval = 4
    gathered = by_choice(asyncio.run(collect(aengine, [5, 6, 7], params)))
    for i in (0, 1):
        # [1] * 10 and [1, 4, 4, 1], where the reader kept up (a busy machine may merge
        # neighbours: AsyncEngine folds what a slow reader left queued)
        assert held_back_by([len(o.new_token_ids) for o in each[i]], 1, 10)
        sizes = [len(o.new_token_ids) for o in gathered[i]]
        assert held_back_by(sizes, 4, 10), sizes
        assert not held_back_by([1] * 10, 4, 10) and held_back_by([1, 8, 1], 4, 10)
        assert [t for o in gathered[i] for t in o.new_token_ids] == [
            t for o in each[i] for t in o.new_token_ids
        ]
        assert "".join(o.new_text for o in gathered[i]) == "".join(o.new_text for o in each[i])
        assert gathered[i][-1].finished and not any(o.finished for o in gathered[i][:-1])
        assert gathered[i][-1].completion_tokens == 10
    assert all_free(aengine.engine)


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)


def test_invalid_input_and_duplicate_ids(aengine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await collect(aengine, [])
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        first = aengine.generate(EngineRequest([5, 6], params, "dup"))
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await collect(aengine, [5, 6], params, "dup")
        await first.aclose()
        # The engine still serves after the errors.
        outs = await collect(aengine, [8, 9])
        assert outs[-1].finish_reason == "length"

    asyncio.run(main())


def test_stopped_engine_refuses_and_fails_open_streams(tokenizer):
    engine = AsyncEngine(tiny_engine(tokenizer))
    engine.start()

    async def main():
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        stream = engine.generate(EngineRequest([5, 6], params))
        await stream.__anext__()
        await engine.stop()
        with pytest.raises(EngineDead):
            async for _ in stream:
                pass
        with pytest.raises(EngineDead):
            await collect(engine, [5, 6])

    asyncio.run(main())
    assert all_free(engine.engine)
