"""The thread policy on the real engine and the real machine: a reply's bits do not depend
on the thread count, a busy process beside the engine takes the count down and its leaving
brings it back, and `--threads` pins it. Asserts on counts, never on wall time."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import pytest
import torch

from app.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.engine.threads import ProcMachine

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


def _reply(engine: LLMEngine, prompt: list[int], counts=None) -> tuple[list[int], list[float]]:
    """Greedy reply with logprobs; `counts` (an iterator) sets the thread count of each step."""
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)
    engine.add_request(EngineRequest(prompt, params, "r"))
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        if counts is not None:
            n = next(counts)
            engine.threads.threads = lambda n=n: n  # the policy's choice, forced
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
    return tokens, logprobs


@pytest.mark.skipif(not TWO_CORES, reason="needs two CPUs to change the count")
def test_changing_the_thread_count_mid_reply_changes_no_bit(smollm, tokenizer, monkeypatch):
    """The prompt in chunks of 37 tokens and the reply decoded, the count flipping between
    1 and 2 every step (and 3 where there are more cores): the same tokens and logprobs as
    an uninterrupted reply at the ceiling. Every kernel computes a row on its own, and
    no reduction is split by thread."""
    from app.model import build

    monkeypatch.setattr(build, "prompt_attention_in_place", lambda: True)  # as on AVX-512
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about lighthouses and the people who kept them."}],
        add_generation_prompt=True, return_dict=False,
    )  # fmt: skip
    config = EngineConfig(
        ModelConfig(),
        CacheConfig(128 << 20),
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, batching="static"),
    )
    steady = LLMEngine(config, smollm)
    assert steady.threads is not None
    want = _reply(steady, prompt)
    flipping = LLMEngine(config, smollm)
    counts = [1, 2, 3] if len(os.sched_getaffinity(0)) >= 3 else [1, 2]
    got = _reply(flipping, prompt, itertools.cycle(counts))
    assert flipping.stats().cpu_threads in counts
    assert got == want


def others_cores(seconds: float = 1.0) -> float:
    """CPU time other processes take on our CPUs per second, over `seconds` (all of them
    where /proc does not say)."""
    machine = ProcMachine()
    first = machine.read()
    time.sleep(seconds)
    last = machine.read()
    if first is None or last is None:
        return float(len(machine.cpus))
    return (last.others - first.others) / (last.wall - first.wall)


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@pytest.mark.skipif(not TWO_CORES, reason="needs two CPUs to contend for one")
def test_a_busy_neighbour_takes_the_count_down_and_its_leaving_brings_it_back(smollm, tokenizer):
    """One stream decoding; a process spinning beside it. The engine's count goes to fewer
    threads while the neighbour runs and back to the ceiling once it has gone. Bounded by
    steps, not time: each phase has many more steps than the policy needs."""
    config = EngineConfig(ModelConfig(), CacheConfig(128 << 20))
    engine = LLMEngine(config, smollm)
    assert engine.threads is not None
    ceiling = engine.threads.ceiling.threads
    if others_cores() > 0.5:  # other work already holds a core: nothing to free
        pytest.skip("the machine is not quiet: a neighbour's leaving frees nothing here")
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    engine.add_request(EngineRequest(tokenizer.encode("Once upon a time"), params, "r"))
    torch.set_num_threads(ceiling)

    def steps_until(done, limit: int) -> bool:
        for _ in range(limit):
            engine.step()
            if done():
                return True
        return False

    policy = engine.threads
    # Warm, and settled at the ceiling: the cost model has seen steps. `policy.current` is
    # the count the policy has settled on; a probe's trial count is not a change.
    steps_until(lambda: False, 50)
    assert steps_until(lambda: policy.current == ceiling and policy.threads() == ceiling, 3000)
    changes = policy.stats.changes
    spinners = [_spinner() for _ in range(ceiling - 1)]  # all but one core busy
    try:
        assert steps_until(lambda: policy.current < ceiling, 3000), (
            f"the count stayed at {ceiling} beside a busy process"
        )
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    assert steps_until(lambda: policy.current == ceiling, 3000), (
        "the count did not come back after the neighbour left"
    )
    assert policy.stats.changes - changes >= 2
    assert engine.stats().thread_changes == policy.stats.changes
    engine.abort("r")
    engine.step()


def test_threads_pins_the_count(smollm):
    before = torch.get_num_threads()
    try:
        config = EngineConfig(ModelConfig(), CacheConfig(64 << 20), num_threads=1)
        engine = LLMEngine(config, smollm)
        assert engine.threads is None and engine.num_threads == 1
        assert engine.stats().cpu_threads == 1 and engine.stats().thread_changes == 0
    finally:
        torch.set_num_threads(before)
