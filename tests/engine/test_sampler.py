"""Sampler: greedy, seeded reproducibility, filter supports, frequencies and penalties, on
fixed logits with small fake request states (no model)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from app.engine.request import Request, SamplingParams
from app.engine.sampler import Sampler, apply_penalties

# probs [0.5, 0.2, 0.15, 0.1, 0.05] at temperature 1
PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]
LOGITS = [math.log(p) for p in PROBS]


@dataclass
class FakeState:
    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


def state(
    params: SamplingParams, seed: int = 0, prompt: Sequence[int] = (), output: Sequence[int] = ()
) -> FakeState:
    return FakeState(params, torch.Generator().manual_seed(seed), list(prompt), list(output))


def draw_many(
    logits: list[float], params: SamplingParams, calls: int = 20, rows: int = 100
) -> Counter:
    """Sample rows * calls tokens from one fixed row of logits, one seed per batch row."""
    sampler = Sampler()
    states = [state(params, seed) for seed in range(rows)]
    counts: Counter = Counter()
    for _ in range(calls):
        batch = torch.tensor([logits] * rows, dtype=torch.float32)
        counts.update(sampler(batch, states).tolist())
    return counts


def test_greedy_is_argmax_and_draws_no_random_numbers() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    states = [state(SamplingParams(temperature=0), i) for i in range(8)]
    before = [s.generator.get_state() for s in states]
    tokens = Sampler()(logits.clone(), states)
    assert tokens.dtype == torch.int64 and tokens.shape == (8,)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert all(torch.equal(b, s.generator.get_state()) for b, s in zip(before, states))


def test_greedy_takes_the_first_of_tied_maxima_and_a_rows_nan() -> None:
    """argmax's answer in the cases where reductions can differ: ties and NaN."""
    logits = torch.zeros(3, 49_152)
    logits[0, [7, 30_000, 49_151]] = 5.0
    logits[1, 12] = 1.0
    logits[1, 40_000] = float("nan")
    logits[2] = -1.0
    tokens = Sampler()(logits.clone(), [state(SamplingParams(temperature=0), i) for i in range(3)])
    assert tokens.tolist() == [7, 40_000, 0]
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_in_mixed_batch() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    states = [
        state(SamplingParams(temperature=0), 0),
        state(SamplingParams(), 1),
        state(SamplingParams(temperature=0), 2),
        state(SamplingParams(top_k=3), 3),
    ]
    greedy_before = states[2].generator.get_state()
    tokens = Sampler()(logits.clone(), states)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert torch.equal(states[2].generator.get_state(), greedy_before)
    assert tokens[3] in logits[3].topk(3).indices


def test_empty_batch() -> None:
    assert Sampler()(torch.empty(0, 10), []).shape == (0,)


def sequence(target: FakeState, others: list[FakeState], position: int, steps: int) -> list[int]:
    """The tokens `target` gets over `steps` calls when sharing a batch with `others`."""
    sampler = Sampler()
    fixed = torch.randn(50, generator=torch.Generator().manual_seed(7))
    noise = torch.Generator().manual_seed(position)
    states = others[:position] + [target] + others[position:]
    out = []
    for _ in range(steps):
        logits = torch.randn(len(states), 50, generator=noise)
        logits[position] = fixed
        out.append(int(sampler(logits, states)[position]))
    return out


def test_seeded_request_repeats_and_ignores_its_batch() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95)
    alone = sequence(state(params, 1234), [], 0, 50)
    again = sequence(state(params, 1234), [], 0, 50)
    others = [
        state(SamplingParams(temperature=0), 5),
        state(SamplingParams(top_k=5), 6),
        state(
            SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5),
            7,
            prompt=[1, 2],
            output=[3, 3],
        ),
        state(SamplingParams(min_p=0.2, temperature=1.5), 8),
    ]
    in_batch = sequence(state(params, 1234), others, 3, 50)
    first = sequence(state(params, 1234), others[::-1], 0, 50)
    assert alone == again == in_batch == first
    assert len(set(alone)) > 5  # really sampled, not a constant
    assert sequence(state(params, 4321), [], 0, 50) != alone


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (SamplingParams(top_p=0.7), {0, 1}),  # cumulative 0.5, 0.7: 0.7 reached with two tokens
        (SamplingParams(top_p=0.75), {0, 1, 2}),
        (SamplingParams(top_p=0.01), {0}),
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=5), {0, 1, 2, 3, 4}),
        (SamplingParams(top_k=50), {0, 1, 2, 3, 4}),
        (SamplingParams(min_p=0.35), {0, 1}),  # floor 0.175
        (SamplingParams(min_p=0.25), {0, 1, 2}),  # floor 0.125
        (SamplingParams(min_p=0.15), {0, 1, 2, 3}),  # floor 0.075
        (SamplingParams(top_p=0.8), {0, 1, 2}),  # cumulative before token 2 is 0.7 < 0.8
        # top_p acts on what top_k left: [0.5, 0.2, 0.15] / 0.85 -> before token 2: 0.82
        (SamplingParams(top_k=3, top_p=0.8), {0, 1}),
        (SamplingParams(top_k=4, min_p=0.25), {0, 1, 2}),
        (SamplingParams(top_p=0.9, min_p=0.25), {0, 1, 2}),
        # temperature 2 first: probs ∝ sqrt(p) = [.340, .215, .186, .152, .107]
        (SamplingParams(temperature=2.0, top_p=0.6), {0, 1, 2}),
        (SamplingParams(temperature=2.0, top_p=0.5), {0, 1}),
    ],
)
def test_filters_sample_exactly_their_support(params: SamplingParams, support: set[int]) -> None:
    assert set(draw_many(LOGITS, params)) == support


@pytest.mark.parametrize(("top_p", "support"), [(0.36, {0}), (0.64, {0, 1}), (0.84, {0, 1, 2})])
def test_top_p_reached_exactly_is_reached_despite_rounding(top_p: float, support: set[int]) -> None:
    # float32 softmax puts the mass before the next token a few ulps below top_p here
    logits = [math.log(p) for p in [0.36, 0.28, 0.2, 0.08, 0.08]]
    assert set(draw_many(logits, SamplingParams(top_p=top_p))) == support


def test_top_k_keeps_ties_with_the_kth_logit() -> None:
    logits = [1.0, 2.0, 1.0, 0.0, 1.0]
    assert set(draw_many(logits, SamplingParams(top_k=2))) == {0, 1, 2, 4}
    assert set(draw_many(logits, SamplingParams(top_k=2, top_p=0.99))) == {0, 1, 2, 4}


def test_top_p_below_float_noise_keeps_the_top_token() -> None:
    logits = [0.0, -1.0, 2.0, 1.0]
    assert set(draw_many(logits, SamplingParams(top_p=1e-9), calls=2)) == {2}


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(top_p=1.0, top_k=0, min_p=0.0)]
)
def test_filters_off_keep_full_support(params: SamplingParams) -> None:
    assert set(draw_many([0.0] * 20, params)) == set(range(20))


def test_one_rows_filters_do_not_leak_into_another() -> None:
    kinds = [
        SamplingParams(top_p=0.5),
        SamplingParams(),
        SamplingParams(top_k=1),
        SamplingParams(min_p=0.9),
    ]
    states = [state(params, seed) for seed in range(50) for params in kinds]  # interleaved
    seen: list[set[int]] = [set() for _ in kinds]
    sampler = Sampler()
    for _ in range(10):
        tokens = sampler(torch.tensor([LOGITS] * len(states)), states).tolist()
        for row, token in enumerate(tokens):
            seen[row % len(kinds)].add(token)
    assert seen == [{0}, {0, 1, 2, 3, 4}, {0}, {0}]


def chi_square(counts: Counter, probs: torch.Tensor) -> float:
    total = sum(counts.values())
    return sum((counts[i] - total * p) ** 2 / (total * p) for i, p in enumerate(probs.tolist()))


def test_frequencies_follow_softmax_of_logits_over_temperature() -> None:
    logits = [1.0, 0.5, 0.0, -0.5, -1.0]
    counts = draw_many(logits, SamplingParams(temperature=0.7), calls=100, rows=200)  # 20,000 draws
    expected = torch.tensor(logits, dtype=torch.float64).div(0.7).softmax(dim=0)
    ignoring_temperature = torch.tensor(logits, dtype=torch.float64).softmax(dim=0)
    # 4 degrees of freedom: P(chi2 > 30) is about 5e-6; the seeds are fixed anyway.
    assert chi_square(counts, expected) < 30
    assert chi_square(counts, ignoring_temperature) > 300


def test_tiny_temperature_is_nearly_greedy_not_nan() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.999, -1.0]])
    assert Sampler()(logits, [state(SamplingParams(temperature=1e-30), 0)]).tolist() == [1]


# logits, prompt [0, 1], output [1, 3, 3]
PENALTY_LOGITS = [2.0, -1.0, 0.5, -0.5, 3.0, 1.0]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # tokens 0, 1, 3 seen: positive logits divided by 2, negative ones multiplied
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.5, -1.0, 3.0, 1.0]),
        (SamplingParams(repetition_penalty=0.5), [4.0, -0.5, 0.5, -0.25, 3.0, 1.0]),
        # output only: token 1 once, token 3 twice; prompt token 0 untouched
        (SamplingParams(presence_penalty=0.5), [2.0, -1.5, 0.5, -1.0, 3.0, 1.0]),
        (SamplingParams(frequency_penalty=0.25), [2.0, -1.25, 0.5, -1.0, 3.0, 1.0]),
        (SamplingParams(frequency_penalty=-1.0), [2.0, 0.0, 0.5, 1.5, 3.0, 1.0]),
        (
            SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
            [1.0, -2.75, 0.5, -2.0, 3.0, 1.0],
        ),
    ],
)
def test_penalties_match_hand_computed_logits(
    params: SamplingParams, expected: list[float]
) -> None:
    logits = torch.tensor([PENALTY_LOGITS])
    apply_penalties(logits, [state(params, prompt=[0, 1], output=[1, 3, 3])])
    assert torch.allclose(logits, torch.tensor([expected]))


def test_rows_without_penalties_are_untouched() -> None:
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    original = logits.clone()
    states = [
        state(SamplingParams(), 0, prompt=[0, 1], output=[1, 3]),
        state(SamplingParams(presence_penalty=1.0), 1, prompt=[2], output=[2, 4]),
        state(SamplingParams(), 2, prompt=[0, 1, 2], output=[5, 5]),
        state(SamplingParams(repetition_penalty=1.5), 3, prompt=[5], output=[0]),
    ]
    apply_penalties(logits, states)
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    assert not torch.equal(logits[1], original[1]) and not torch.equal(logits[3], original[3])


def test_penalties_with_a_real_request() -> None:
    request = Request("r", [0, 1], SamplingParams(repetition_penalty=2.0), max_tokens=4)
    request.append_output_token(3)
    logits = torch.tensor([PENALTY_LOGITS])
    apply_penalties(logits, [request])
    assert torch.allclose(logits, torch.tensor([[1.0, -2.0, 0.5, -1.0, 3.0, 1.0]]))


def test_token_ids_outside_the_vocabulary_raise() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        apply_penalties(
            torch.zeros(2, 6), [state(SamplingParams(frequency_penalty=1.0), output=[6])] * 2
        )


def reference_penalties(logits: list[float], s: FakeState) -> list[float]:
    """The documented formulas, one token at a time."""
    p, out = s.params, list(logits)
    for token in range(len(out)):
        if token in s.prompt_token_ids or token in s.output_token_ids:
            r = p.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = s.output_token_ids.count(token)
        out[token] -= p.presence_penalty * (count > 0) + p.frequency_penalty * count
    return out


penalty_params = st.builds(
    SamplingParams,
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.1, 3.0)),
    presence_penalty=st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
    frequency_penalty=st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            penalty_params,
            st.lists(st.integers(0, 7), max_size=12),
            st.lists(st.integers(0, 7), max_size=12),
            st.lists(st.floats(-5, 5, width=32), min_size=8, max_size=8),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_penalties_match_the_documented_formulas(
    rows: list[tuple[SamplingParams, list[int], list[int], list[float]]],
) -> None:
    states = [state(p, prompt=prompt, output=output) for p, prompt, output, _ in rows]
    logits = torch.tensor([row_logits for *_, row_logits in rows])
    apply_penalties(logits, states)
    expected = [reference_penalties(row[-1], s) for row, s in zip(rows, states, strict=True)]
    assert torch.allclose(logits, torch.tensor(expected), atol=1e-5)


def test_sampler_accepts_strided_logits_with_penalties() -> None:
    hidden = torch.tensor([[[0.0, 0.0, 0.0], [3.0, 2.0, 1.0]]] * 2)  # [B, T, V]; use the last
    assert not hidden[:, -1].is_contiguous()
    states = [state(SamplingParams(temperature=0, frequency_penalty=1.0), output=[0, 0])] * 2
    assert Sampler()(hidden[:, -1], states).tolist() == [1, 1]
    with pytest.raises(ValueError, match="contiguous"):
        apply_penalties(hidden[:, -1], states)


def test_greedy_picks_argmax_of_penalised_logits() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    states = [
        state(SamplingParams(temperature=0, frequency_penalty=1.0), 0, output=[0, 0]),  # 3 - 2 < 2
        state(SamplingParams(temperature=0), 1, output=[0]),  # no penalty: still token 0
    ]
    assert Sampler()(logits, states).tolist() == [1, 0]


NOISE = 1e-6  # logits closer than this are a tie for the reference


def reference_support(logits: list[float], params: SamplingParams) -> set[int]:
    """Tokens a correct sampler may return, in float64, generous at ties and float noise."""
    vocab = len(logits)
    z = torch.tensor(logits, dtype=torch.float64)
    if params.temperature == 0:
        return {i for i in range(vocab) if z[i] == z.max()}
    z /= params.temperature
    kept = torch.ones(vocab, dtype=torch.bool)
    if 0 < params.top_k < vocab:
        # Ties with the k-th stay, and so do logits a float32 rounding away from it.
        kept = z >= z.sort(descending=True).values[params.top_k - 1] - NOISE
    allowed = {i for i in range(vocab) if kept[i]}
    if params.top_p < 1:
        # Renormalise over what top_k kept, then allow a token when the mass strictly above
        # it is below top_p. Tied tokens may come in any order, and "tied" includes logits
        # closer than float32 can tell apart in a softmax (found by hypothesis: 0.0 and a
        # denormal 5.6e-43 have the same probability in float32).
        probs = torch.zeros(vocab, dtype=torch.float64)
        probs[kept] = z[kept].softmax(dim=0)
        allowed = {i for i in allowed if probs[z > z[i] + NOISE].sum() < params.top_p + 1e-4}
    if params.min_p > 0:
        allowed = {i for i in allowed if math.exp(z[i] - z.max()) >= params.min_p - 1e-4}
    return allowed | {int(z.argmax())}


row_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 45)),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, width=32), min_size=2, max_size=40),
    rows=st.lists(row_params, min_size=1, max_size=6),
    seed=st.integers(0, 2**32),
)
@example(  # a denormal apart from a tie at the top_p boundary
    logits=[0.0, 0.5, 5.633219826585765e-43],
    rows=[SamplingParams(temperature=1.0, top_p=0.5)],
    seed=0,
)
def test_sampled_tokens_stay_in_reference_support(
    logits: list[float], rows: list[SamplingParams], seed: int
) -> None:
    batch = rows * 4  # each setting on several rows, with different seeds, in a mixed batch
    states = [state(params, seed + i) for i, params in enumerate(batch)]
    tokens = Sampler()(torch.tensor([logits] * len(batch)), states)
    for params, token in zip(batch, tokens.tolist(), strict=True):
        assert token in reference_support(logits, params), params
