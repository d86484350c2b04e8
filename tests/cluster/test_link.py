"""The link between a front and a replica (app/cluster/link.py) on a real loopback
socket, without Ray: requests in and one frame per step out, a refusal crossing as its
type, a connection without the key closed unread, and a front that goes away leaving
nothing running."""

import asyncio
import contextlib
import dataclasses

import pytest

from app.cluster.link import Beat, FrontLink
from app.cluster.replica import Replica, ReplicaBeat
from app.cluster.simulated import SimulatedReplica
from app.engine.engine_request import EngineRequest
from app.engine.errors import ContextTooLong
from app.engine.outputs import FinishedRequestStats, RequestOutput
from app.engine.request import SamplingParams
from tests.tiny import tiny_parts


async def read_until_ended(link: FrontLink, request_ids) -> list[list]:
    frames: list[list] = []
    ended: set[str] = set()
    batches = link.batches()
    while not set(request_ids) <= ended:
        batch = await asyncio.wait_for(anext(batches), 60)
        frames.append(batch)
        ended |= {rid for rid, item in batch if not isinstance(item, RequestOutput)}
    return frames


@contextlib.asynccontextmanager
async def linked(replica):
    """A front's link to `replica` on loopback; the link closed and the replica stopped
    after."""
    try:
        link = await FrontLink.connect(await replica._links.open("front", "127.0.0.1"))
        try:
            yield link
        finally:
            link.close()
    finally:
        await replica.stop()


def test_requests_go_in_and_each_step_comes_out_as_one_frame(tokenizer):
    async def main():
        replica = SimulatedReplica(*tiny_parts(tokenizer), 200.0)
        async with linked(replica) as link:
            for rid in ("a", "b"):
                link.submit(EngineRequest([1, 2, 3], SamplingParams(max_tokens=6), rid))
            frames = await read_until_ended(link, ["a", "b"])
            return frames

    frames = asyncio.run(main())
    outputs = [item for batch in frames for _, item in batch if isinstance(item, RequestOutput)]
    assert len(outputs) == 12 and sum(len(o.new_token_ids) for o in outputs) == 12
    assert all(len({rid for rid, _ in batch}) == 2 for batch in frames)  # a step, one frame
    ends = [item for batch in frames for _, item in batch if not isinstance(item, RequestOutput)]
    assert len(ends) == 2 and all(isinstance(e, FinishedRequestStats) for e in ends)


def test_a_refusal_crosses_the_link_as_its_type_and_an_abort_follows_its_submit(tokenizer):
    async def main():
        replica = Replica(*tiny_parts(tokenizer))
        async with linked(replica) as link:
            link.submit(EngineRequest([1] * 5000, SamplingParams(max_tokens=1), "long"))
            endless = SamplingParams(max_tokens=1000, ignore_eos=True)
            link.submit(EngineRequest([1, 2, 3], endless, "cut"))
            link.abort("cut")  # right behind its submit, on the same connection
            frames = await read_until_ended(link, ["long", "cut"])
            return frames

    frames = asyncio.run(main())
    by_request: dict[str, list] = {}
    for batch in frames:
        for rid, item in batch:
            by_request.setdefault(rid, []).append(item)
    refusal = by_request["long"][-1]
    assert isinstance(refusal, ContextTooLong) and refusal.num_tokens == 5000
    cut = [o for o in by_request["cut"] if isinstance(o, RequestOutput)]
    assert sum(len(o.new_token_ids) for o in cut) < 1000


@pytest.mark.parametrize("key", [b"", b"x" * 32])
def test_a_connection_without_the_key_is_closed_unread(tokenizer, key):
    async def main():
        replica = SimulatedReplica(*tiny_parts(tokenizer), 200.0)
        try:
            address = await replica._links.open("front", "127.0.0.1")
            intruder = await FrontLink.connect(dataclasses.replace(address, key=key))
            if not key:
                intruder.close()  # said nothing at all
            else:
                intruder.submit(EngineRequest([1, 2, 3], SamplingParams(max_tokens=5), "x"))
                assert await asyncio.wait_for(intruder.reader.read(), 30) == b""  # closed
            await asyncio.sleep(0.1)
            refused = dict(replica._running)
            # The front with the key still gets through afterwards.
            link = await FrontLink.connect(address)
            link.submit(EngineRequest([1, 2, 3], SamplingParams(max_tokens=2), "ok"))
            frames = await read_until_ended(link, ["ok"])
            link.close()
            return refused, frames
        finally:
            await replica.stop()

    refused, frames = asyncio.run(main())
    assert refused == {}  # nothing the intruder sent was unpickled or run
    assert any(rid == "ok" for batch in frames for rid, _ in batch)


def test_a_front_that_goes_away_leaves_nothing_running(tokenizer):
    async def main():
        replica = SimulatedReplica(*tiny_parts(tokenizer), 200.0)
        async with linked(replica) as link:
            link.submit(EngineRequest([1, 2, 3], SamplingParams(max_tokens=100_000), "long"))
            batches = link.batches()
            await asyncio.wait_for(anext(batches), 30)  # it runs
            running = set(replica._running)
            link.close()
            for _ in range(100):  # aborted: gone at the replica's next step
                await asyncio.sleep(0.05)
                if not replica._running:
                    break
            return running, set(replica._running)

    running, after = asyncio.run(main())
    assert running == {"long"} and after == set()


def test_a_session_released_over_the_link_lets_its_pinned_blocks_go(tokenizer):
    async def main():
        replica = Replica(*tiny_parts(tokenizer))
        async with linked(replica) as link:
            params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
            link.submit(EngineRequest(list(range(1, 40)), params, "t1", session_id="conv"))
            await read_until_ended(link, ["t1"])
            pinned = replica.engine.stats().sessions_pinned
            link.release_session("conv")
            for _ in range(200):
                await asyncio.sleep(0.02)
                if replica.engine.stats().sessions_pinned == 0:
                    break
            return pinned, replica.engine.stats().sessions_pinned

    assert asyncio.run(main()) == (1, 0)


def test_a_replica_listens_on_loopback_for_a_front_on_its_node_else_on_its_address(
    monkeypatch,
):
    ray = pytest.importorskip("ray")
    from app.cluster.replica import link_host

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.7")
    assert link_host("192.0.2.7") == "127.0.0.1"  # the same node: never off the machine
    assert link_host("192.0.2.8") == "192.0.2.7"  # another node reaches it at its address


def test_the_link_carries_the_replicas_heartbeat_between_its_frames(tokenizer):
    """Asked for beats, the replica sends its counters every beat_s without being asked
    (the front makes no Ray call for a replica it has a link to), whole frames between
    the outputs' frames."""

    async def main():
        replica = SimulatedReplica(*tiny_parts(tokenizer), 200.0)
        try:
            address = await replica._links.open("front", "127.0.0.1", Beat(0.05, 16))
            link = await FrontLink.connect(address)
            link.submit(EngineRequest([1, 2, 3], SamplingParams(max_tokens=40), "a"))
            frames, batches = [], link.batches()
            while not any(
                isinstance(f, list) and any(r == "a" and not isinstance(i, RequestOutput)
                                            for r, i in f)
                for f in frames
            ):  # fmt: skip
                frames.append(await asyncio.wait_for(anext(batches), 30))
            await asyncio.sleep(0.3)  # idle: only beats
            link.close()
            frames += [f async for f in batches]
            return frames
        finally:
            await replica.stop()

    frames = asyncio.run(main())
    beats = [f for f in frames if isinstance(f, ReplicaBeat)]
    outputs = [
        i for f in frames if isinstance(f, list) for _, i in f if isinstance(i, RequestOutput)
    ]
    assert sum(len(o.new_token_ids) for o in outputs) == 40
    assert len(beats) >= 4 and all(b.stats.steps >= 0 for b in beats)
    assert beats[-1].stats.num_running == 0


def test_beats_after_a_links_first_carry_only_what_changed_and_add_up_to_the_pool(tokenizer):
    """A whole beat (4,096 hashes) cost the front ~0.4 ms a replica a second. Over a link
    the first beat is whole and each later one carries the blocks cached and let go since
    the one before: applied in order, the router knows exactly what the pool holds."""
    from app.cluster.router import Router

    async def main():
        replica = Replica(*tiny_parts(tokenizer))
        try:
            address = await replica._links.open("front", "127.0.0.1", Beat(0.05, 4096))
            link = await FrontLink.connect(address)
            batches, beats = link.batches(), []

            async def beat() -> ReplicaBeat:
                while not isinstance(f := await asyncio.wait_for(anext(batches), 30),
                                     ReplicaBeat):  # fmt: skip
                    pass
                beats.append(f)
                return f

            for n, rid in enumerate(("a", "b")):  # two prompts: blocks to cache
                prompt = list(range(100 * n + 1, 100 * n + 70))
                link.submit(EngineRequest(prompt, SamplingParams(max_tokens=3), rid))
                while not (await beat()).block_hashes:
                    pass
            replica.engine.engine.kv.pool.reset_prefix_cache()  # everything let go
            while (await beat()).whole or not beats[-1].dropped:
                pass
            held = list(replica.engine.engine.kv.pool.cached_hashes(4096))
            link.close()
            return beats, held
        finally:
            await replica.stop()

    beats, held = asyncio.run(main())
    told = next(k for k, b in enumerate(beats) if b.block_hashes)  # the first with blocks
    assert all(b.whole for b in beats[: told + 1]) and not any(b.whole for b in beats[told + 1 :])
    router = Router()
    seen: list[set[bytes]] = []
    for b in beats:
        if b.whole:
            router.publish(0, b.block_hashes)
        else:
            router.update(0, b.block_hashes, b.dropped)
        seen.append(set(router._held[0]))
    assert max(len(s) for s in seen) >= 8  # both prompts' blocks were told
    assert set(router._held[0]) == set(held)  # and their letting go
    # Each block told once as cached (and once let go), not once a beat.
    assert sum(len(b.block_hashes) for b in beats) <= max(len(s) for s in seen) + 8


def test_a_beat_is_whole_over_ray_and_for_a_links_first():
    stats = None  # carried as it is
    assert ReplicaBeat.of(stats, [b"a", b"b"]).whole  # over Ray: no earlier beat to go by
    told: set[bytes] = set()
    first = ReplicaBeat.of(stats, [b"a", b"b"], told)
    assert first.whole and first.block_hashes == (b"a", b"b") and told == {b"a", b"b"}
    later = ReplicaBeat.of(stats, [b"b", b"c"], told)
    assert not later.whole and later.block_hashes == (b"c",) and later.dropped == (b"a",)
    assert told == {b"b", b"c"}
