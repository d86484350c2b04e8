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
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from app.engine.errors import BadParameter
from app.engine.request import ResponseFormat

SEPARATORS = (", ", ": ")
_OBJECT_SCHEMA = '{"type": "object"}'
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[04:47:06] /project/x.cc:94: "


class GrammarCompiler:
    """Compiles response formats for one tokenizer into per-request matchers. xgrammar is
    imported and its tokenizer table built (~0.15 s) on first use only."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()  # callers compile from several threads

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # xgrammar caches compiled grammars by schema text itself.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, fmt: ResponseFormat, stop_token_ids: Sequence[int] = ()) -> Grammar:
        """A fresh matcher for `fmt`. Raises BadParameter("response_format") naming what
        the library rejected in the schema."""
        import xgrammar as xgr

        schema = _OBJECT_SCHEMA if fmt.kind == "json_object" else fmt.schema
        assert schema is not None
        try:
            json.loads(schema)
        except json.JSONDecodeError as exc:
            raise BadParameter(
                f"response_format: the schema is not JSON: {exc}", "response_format"
            ) from None
        try:
            compiled = self._get().compile_json_schema(
                schema, any_whitespace=False, separators=SEPARATORS, strict_mode=True
            )
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
            reason = _LOG_PREFIX.sub("", (str(exc).strip() or type(exc).__name__).splitlines()[0])
            raise BadParameter(
                f"response_format: the JSON schema is not supported: {reason}", "response_format"
            ) from None
        stops = sorted(stop_token_ids) or self.stop_token_ids
        return Grammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stops), stops)


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
