"""Structured output: a response_format (a JSON Schema, or any JSON object) becomes a token
mask applied inside the batched sampler, so constrained and free requests share a step.

The grammar work is xgrammar's (Dong et al. 2024): schema -> grammar -> a matcher per
request that, given the tokens so far, says which tokens may come next as a bitmask over
the vocabulary. Measured on this project's CPU with SmolLM2's 49,152-token vocabulary
(bench/README.md), it filled a mask in 5-40 us and applied 32 of them in ~0.06 ms;
llguidance took 10-140 us a mask, and its mask kernel (torch.compile) was ~100x slower on
the CPU.

The JSON is compact (", " and ": " between items, no other whitespace): a small model
given free whitespace can loop on newlines forever. The grammar decides the end too: once
the value is complete, only a stop token may follow, and the engine ends the request
there (Grammar.must_end) without spending a step on it.

Compiling is the costly part, and a user chooses the schema: a 20,000-value enum took 12 s
here, a schema nested 400 deep 7 s. So a schema is refused beyond `max_schema_bytes` or
`max_depth` (cheap checks), compiled on a worker thread of its own (xgrammar lets go of the
GIL while it compiles: the event loop and the engine's thread run on), waited for at most
`max_compile_s` (then refused: a BadParameter, which the server answers 400 / bad_request),
and kept, result or refusal, in a cache keyed by the schema text, so a repeated schema
costs nothing. A compile that outlives its wait still finishes and is cached; one worker
means such runaways queue behind each other rather than take every core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from app.engine.errors import BadParameter


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on the reply's text, applied as a token mask while sampling
    (app.engine.structured): "json_object" (any JSON object) or "json_schema" (`schema`, a
    JSON Schema as JSON text, followed strictly)."""

    kind: str
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema"):
            raise BadParameter(
                f"response_format type must be json_object or json_schema, not {self.kind!r}",
                "response_format",
            )
        if (self.kind == "json_schema") != (self.schema is not None):
            raise BadParameter("a json_schema response_format needs its schema", "response_format")


SEPARATORS = (", ", ": ")
_OBJECT_SCHEMA = '{"type": "object"}'
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[04:47:06] /project/x.cc:94: "

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]")

MAX_SCHEMA_BYTES = 64 << 10  # OpenAI allows ~120,000 characters of names and enum values
MAX_SCHEMA_DEPTH = 64  # nesting of JSON objects and arrays in the schema text (OpenAI: 10 levels)
MAX_COMPILE_S = 5.0
CACHE_ENTRIES = 256
CACHE_BYTES = 256 << 20  # compiled grammars' own size (xgrammar's memory_size_bytes)


class GrammarCompiler:
    """Compiles response formats for one tokenizer into per-request matchers, under the
    caps above. xgrammar is imported and its tokenizer table built (~0.15 s) on first use
    only, on the worker thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_schema_bytes: int = MAX_SCHEMA_BYTES,
        max_depth: int = MAX_SCHEMA_DEPTH,
        max_compile_s: float = MAX_COMPILE_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_schema_bytes = max_schema_bytes
        self.max_depth = max_depth
        self.max_compile_s = max_compile_s
        self._compiler: Any = None
        self._lock = threading.Lock()  # callers come from several threads
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        # schema text -> its compile (done: a CompiledGrammar, or the BadParameter it raised)
        self._compiles: OrderedDict[str, concurrent.futures.Future] = OrderedDict()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # Our cache below keeps what is compiled: xgrammar's would keep it twice.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    async def prepare(self, fmt: ResponseFormat) -> None:
        """Compile `fmt` off the event loop (and into the cache) without holding a thread
        while waiting; compile() then finds it. Raises BadParameter("response_format")."""
        compiling = self._compile_of(fmt)
        try:
            # shield: one request's wait ending must not cancel a compile others share.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiling)),
                                   self.max_compile_s)  # fmt: skip
        except TimeoutError:
            raise self._too_slow() from None

    def compile(self, fmt: ResponseFormat, stop_token_ids: Sequence[int] = ()) -> Grammar:
        """A fresh matcher for `fmt`. Raises BadParameter("response_format") naming what
        is wrong with the schema, or what the library rejected in it."""
        import xgrammar as xgr

        try:
            compiled = self._compile_of(fmt).result(timeout=self.max_compile_s)
        except concurrent.futures.TimeoutError:
            raise self._too_slow() from None
        stops = sorted(stop_token_ids) or self.stop_token_ids
        return Grammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stops), stops)

    def _compile_of(self, fmt: ResponseFormat) -> concurrent.futures.Future:
        """The compile of `fmt`'s schema: cached, under way, or started now."""
        schema = self._checked(fmt)
        with self._lock:
            compiling = self._compiles.get(schema)
            if compiling is not None:
                self._compiles.move_to_end(schema)
                return compiling
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(1, "grammar-compile")
            compiling = self._worker.submit(self._run, schema)
            self._compiles[schema] = compiling
            compiling.add_done_callback(lambda _: self._bound())
            return compiling

    def _checked(self, fmt: ResponseFormat) -> str:
        schema = _OBJECT_SCHEMA if fmt.kind == "json_object" else fmt.schema
        assert schema is not None
        size = len(schema.encode("utf-8", "surrogatepass"))
        if size > self.max_schema_bytes:
            raise BadParameter(
                f"response_format: the JSON schema is {size} bytes; at most "
                f"{self.max_schema_bytes} are accepted",
                "response_format",
            )
        if _depth(schema) > self.max_depth:
            raise BadParameter(
                f"response_format: the JSON schema nests deeper than {self.max_depth} levels",
                "response_format",
            )
        try:
            json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise BadParameter(
                f"response_format: the schema is not JSON: {exc}", "response_format"
            ) from None
        return schema

    def _run(self, schema: str) -> Any:
        """On the worker: the compiled grammar. Raises BadParameter."""
        try:
            return self._get().compile_json_schema(
                schema, any_whitespace=False, separators=SEPARATORS, strict_mode=True
            )
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
            reason = _LOG_PREFIX.sub("", (str(exc).strip() or type(exc).__name__).splitlines()[0])
            raise BadParameter(
                f"response_format: the JSON schema is not supported: {reason}", "response_format"
            ) from None

    def _bound(self) -> None:
        """Forget the least recently used compiles past the cache's bounds."""
        with self._lock:
            done = [(k, f) for k, f in self._compiles.items() if f.done()]
            size = sum(_size(f) for _, f in done)
            for key, compiled in done:
                if len(self._compiles) <= CACHE_ENTRIES and size <= CACHE_BYTES:
                    break
                size -= _size(compiled)
                del self._compiles[key]

    def _too_slow(self) -> BadParameter:
        return BadParameter(
            f"response_format: the JSON schema takes longer than {self.max_compile_s:g} s to "
            "compile: simplify it (fewer enum values, less nesting)",
            "response_format",
        )


def _depth(text: str) -> int:
    """How deep brackets nest in JSON text, strings aside (no parse: a deep text is what
    must not reach the parser)."""
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    return max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def _size(compiling: concurrent.futures.Future) -> int:
    if compiling.exception() is not None:
        return 0
    return int(compiling.result().memory_size_bytes)


class Grammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, stop_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids

    def fork(self) -> Grammar:
        """An independent copy in the same state (another choice of the same prompt)."""
        return Grammar(self.matcher.fork(), self.stop_token_ids)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar forbids it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the value is complete and ended."""
        return bool(self.matcher.is_terminated())

    def must_end(self, vocab_size: int) -> bool:
        """The value is complete and nothing but a stop token may follow."""
        if self.is_terminated:
            return True
        if not self.matcher.is_completed():
            return False
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, vocab_size)
        self.matcher.fill_next_token_bitmask(mask, 0)
        allowed = _unpack(mask[0], vocab_size).nonzero().view(-1).tolist()
        return set(allowed) <= set(self.stop_token_ids)


@dataclass(frozen=True)
class TokenMasks:
    """One step's masks: `bitmask` [B, ceil(V / 32)] int32 (a set bit allows a token),
    filled for the batch rows in `rows`; the other rows are left unconstrained."""

    bitmask: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Set disallowed tokens' logits to -inf, in place, in the constrained rows."""
        import xgrammar as xgr

        # The matchers fill the bitmask on the host; a GPU's logits need it on their side.
        bitmask = self.bitmask.to(logits.device, non_blocking=True)  # no copy on the CPU
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=logits.shape[1], indices=self.rows
        )


def token_masks(grammars: Sequence[Grammar | None], vocab_size: int) -> TokenMasks | None:
    """The masks of a batch whose row i is constrained by grammars[i] (None: free).
    None when no row is constrained (the common case costs one pass over the list)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    for i in rows:
        grammars[i].matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
    return TokenMasks(bitmask, rows)


def _unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[W] int32 bitmask -> [vocab_size] bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(-1)[:vocab_size].bool()
