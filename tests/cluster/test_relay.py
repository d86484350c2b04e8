"""The replica's side of the per-step relay, without Ray: one stream item carries a
step's outputs for all of a front's requests, each request ends with its stats, a
refusal travels as its error, and an abort ends a request at the next step."""

import asyncio

import pytest

from app.cluster.replica import Replica
from app.engine.engine_request import EngineRequest
from app.engine.errors import ContextTooLong
from app.engine.outputs import FinishedRequestStats, RequestOutput
from app.engine.request import FinishReason, SamplingParams
from tests.tiny import tiny_parts


async def read_until_ended(stream, request_ids, items):
    """Read the stream into `items` until every request (in items already or not) ended."""

    def ended():
        return {r for batch in items for r, item in batch if not isinstance(item, RequestOutput)}

    while not set(request_ids) <= ended():
        items.append(await asyncio.wait_for(anext(stream), 60))


def test_one_item_carries_a_step_for_every_request(tokenizer):
    async def main():
        replica = Replica(*tiny_parts(tokenizer))
        try:
            params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
            ids = [f"r{i}" for i in range(3)]
            for rid in ids:
                replica.submit("front", EngineRequest([1, 2, 3, 4 + len(rid)], params, rid))
            items = []
            await read_until_ended(replica.stream("front"), ids, items)
            return items
        finally:
            await replica.stop()

    items = asyncio.run(main())
    tokens = {rid: 0 for rid in ("r0", "r1", "r2")}
    for batch in items:
        for rid, item in batch:
            if isinstance(item, RequestOutput):
                tokens[rid] += len(item.new_token_ids)
    assert tokens == {"r0": 8, "r1": 8, "r2": 8}
    # Decoding together, the three requests' tokens of a step leave as one item.
    assert any(len({rid for rid, _ in batch}) == 3 for batch in items)
    assert len(items) < 24
    ends = [item for batch in items for _, item in batch if not isinstance(item, RequestOutput)]
    assert all(isinstance(e, FinishedRequestStats) for e in ends) and len(ends) == 3


def test_a_refusal_and_an_abort_end_their_requests(tokenizer):
    async def main():
        replica = Replica(*tiny_parts(tokenizer))
        try:
            stream = replica.stream("front")
            replica.submit("front", EngineRequest([1] * 5000, SamplingParams(max_tokens=1), "long"))
            replica.abort("early")  # before it is submitted: it never runs
            replica.submit("front", EngineRequest([1, 2], SamplingParams(), "early"))
            cut = SamplingParams(max_tokens=1000, ignore_eos=True)
            replica.submit("front", EngineRequest([1, 2, 3], cut, "cut"))
            items = []
            while not any(rid == "cut" for batch in items for rid, _ in batch):
                items.append(await asyncio.wait_for(anext(stream), 60))
            replica.abort("cut")
            await read_until_ended(stream, ["long", "early", "cut"], items)
            return items
        finally:
            await replica.stop()

    items = asyncio.run(main())
    by_request = {}
    for batch in items:
        for rid, item in batch:
            by_request.setdefault(rid, []).append(item)
    assert isinstance(by_request["long"][-1], ContextTooLong)  # refused, as its type
    assert by_request["early"] == [None]
    cut = [o for o in by_request["cut"] if isinstance(o, RequestOutput)]
    assert cut[-1].finish_reason == FinishReason.ABORT
    assert cut[-1].completion_tokens < 1000


@pytest.mark.parametrize("steps_per_s", [200.0])
def test_a_simulated_replica_steps_every_request_at_its_rate(tokenizer, steps_per_s):
    from app.cluster.simulated import SimulatedReplica

    async def main():
        config, loaded = tiny_parts(tokenizer)
        replica = SimulatedReplica(config, loaded, steps_per_s)
        for rid in ("a", "b"):
            replica.submit("front", EngineRequest([1, 2, 3], SamplingParams(max_tokens=5), rid))
        items = []
        await read_until_ended(replica.stream("front"), ["a", "b"], items)
        await replica.stop()
        return items

    items = asyncio.run(main())
    outputs = [item for batch in items for _, item in batch if isinstance(item, RequestOutput)]
    assert len(outputs) == 10 and outputs[-1].finish_reason == FinishReason.LENGTH
    assert all(len({rid for rid, _ in batch}) == 2 for batch in items)  # one item a step
