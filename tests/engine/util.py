"""Drive an LLMEngine by hand and collect what it produced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.engine import LLMEngine


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    outputs: int = 0


def run(
    engine: LLMEngine,
    results: dict[str, Result] | None = None,
    before_step: Callable[[int], None] | None = None,
    max_steps: int = 10_000,
) -> dict[str, Result]:
    """Step until idle. `before_step(i)` may add or abort requests; integrity is checked
    after every step (the engine's debug_checks) and once more at the end."""
    results = {} if results is None else results
    for i in range(max_steps):
        if before_step is not None:
            before_step(i)
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            r = results.setdefault(out.request_id, Result())
            r.text += out.new_text
            r.token_ids += out.new_token_ids
            r.outputs += 1
            r.prompt_tokens = out.prompt_tokens
            if out.finished:
                assert r.finish_reason is None, "two final outputs for one request"
                r.finish_reason = str(out.finish_reason)
                r.cached_tokens = out.cached_tokens
        engine.check_integrity()
    else:
        raise AssertionError("engine did not finish")
    return results


def all_free(engine: LLMEngine) -> bool:
    pool = engine.kv.pool
    return pool.num_free_blocks == pool.num_blocks


def held_back_by(sizes: list[int], interval: int, total: int) -> bool:
    """Whether outputs carrying `sizes` tokens are a stream of `total` tokens held back to
    `interval` at a time (the first alone, then `interval` each, the rest with the last),
    where a reader that fell behind may have had neighbours merged into one."""
    if sum(sizes) != total or any(s <= 0 for s in sizes):
        return False
    if len(sizes) == 1:
        return True
    tail = (total - 1) % interval or interval  # the last output's own tokens
    return (
        sizes[0] % interval == 1 % interval
        and all(s % interval == 0 for s in sizes[1:-1])
        and (sizes[-1] - tail) % interval == 0
    )
