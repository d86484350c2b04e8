"""What a schema may cost (app.engine.structured): refused past a size or a depth before
any work, refused past a compile time (the compile goes on, off the caller's thread, and is
kept), and compiled once however often it is asked for."""

import asyncio
import json
import threading
import time

import pytest

from app.engine.errors import BadParameter
from app.engine.request import ResponseFormat
from app.engine.structured import GrammarCompiler


def schema(value) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(value))


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}, "required": ["a"]}
    return value


def enum(n: int, tag: str = "v") -> ResponseFormat:
    return schema({"enum": [f"{tag}-{i}" for i in range(n)]})


@pytest.fixture
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_a_schema_over_the_size_cap_is_refused_before_any_work(compiler):
    big = enum(20_000)  # ~290 KB: 12 s of compiling on this machine
    with pytest.raises(BadParameter, match="bytes; at most") as refused:
        compiler.compile(big)
    assert refused.value.name == "response_format"
    assert not compiler._compiles  # nothing was started


def test_a_schema_nested_past_the_depth_cap_is_refused(compiler):
    with pytest.raises(BadParameter, match="nests deeper than 64"):
        compiler.compile(schema(nested(400)))  # 24 KB, 7 s of compiling here
    with pytest.raises(BadParameter, match="nests deeper"):
        compiler.compile(ResponseFormat("json_schema", "[" * 60_000))  # no parser sees it
    compiler.compile(schema(nested(20)))  # well within: compiled


def test_a_compile_past_the_time_cap_is_refused_and_still_kept(compiler):
    compiler.compile(ResponseFormat("json_object"))  # the tokenizer's table is built
    compiler.max_compile_s = 0.001
    slow = enum(3000, "slow")  # tens of ms: past a 1 ms cap
    with pytest.raises(BadParameter, match=r"takes longer than 0\.001 s"):
        compiler.compile(slow)
    compiler.max_compile_s = 30.0
    compiler._compile_of(slow).result(30)  # it went on meanwhile
    began = time.perf_counter()
    grammar = compiler.compile(slow)  # now from the cache
    assert time.perf_counter() - began < 5  # generous: it is not compiled again
    assert grammar.accept(_first_token(compiler, '"'))  # a string of the enum begins


def _first_token(compiler, text):
    return compiler.tokenizer.encode(text, add_special_tokens=False)[0]


def test_a_repeated_schema_is_compiled_once(compiler, monkeypatch):
    runs = []
    run = compiler._run
    monkeypatch.setattr(compiler, "_run", lambda s: runs.append(s) or run(s))
    fmt = enum(50, "once")
    threads = [threading.Thread(target=compiler.compile, args=(fmt,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    compiler.compile(fmt)
    assert len(runs) == 1


def test_a_refusal_is_kept_too(compiler, monkeypatch):
    runs = []
    run = compiler._run
    monkeypatch.setattr(compiler, "_run", lambda s: runs.append(s) or run(s))
    bad = schema({"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}})
    for _ in range(3):
        with pytest.raises(BadParameter, match="not supported"):
            compiler.compile(bad)
    assert len(runs) == 1


def test_prepare_waits_off_the_event_loop(compiler):
    """While a compile runs, the loop that waits for it keeps ticking."""

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        ticker = asyncio.create_task(tick())
        await compiler.prepare(enum(3000, "loop"))
        ticker.cancel()
        return ticks

    assert asyncio.run(main()) > 0
    compiler.compile(enum(3000, "loop"))  # prepared: the cache has it
