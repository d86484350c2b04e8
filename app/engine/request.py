"""A request's life: sampling parameters, token counters and timings.

There is no prefill or decode phase. A request holds `all_token_ids` (prompt, then output)
and `num_computed_tokens` (how many of them have K/V in the cache). The scheduler grants
tokens from `num_computed_tokens` up to `num_tokens`; a decoding request is simply one with
exactly one token left to compute (the one it sampled last step).
"""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from app.engine.errors import BadParameter
from app.engine.structured import ResponseFormat

if TYPE_CHECKING:
    from app.engine.detokenizer import IncrementalDetokenizer
    from app.engine.logprobs import Logprob
    from app.engine.structured import Grammar

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_N = 128  # OpenAI's limit; the engine also keeps n within max_num_seqs
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise BadParameter (a
    ValueError) naming the parameter, with a message fit to show the user.

    temperature == 0 is greedy. top_k == 0, top_p == 1 and min_p == 0 switch those filters
    off. repetition_penalty (> 1 discourages) acts on prompt and output tokens, as in
    transformers and vLLM: a positive logit is divided by it, a negative one multiplied.
    presence_penalty and frequency_penalty act on output tokens only, as in OpenAI's API:
    logit -= presence * (count > 0) + frequency * count.
    """

    max_tokens: int | None = None  # None: up to the context window (the one default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Choices sharing the prompt: computed once, its blocks shared (see LLMEngine). Choice
    # i samples with its own generator, seeded `seed + i` when a seed is given.
    n: int = 1
    # Log-probabilities of each sampled token and its `logprobs` most likely alternatives
    # (None: not computed; 0: the sampled token only), and the same for every prompt token
    # but the first (`prompt_logprobs`). From the model's logits in fp32, before
    # logit_bias, penalties, temperature, filters and any response_format mask.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    # Added to the logits of these token ids before sampling: ((token_id, bias), ...).
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # Accept lists (JSON) and a single stop string, store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        self._validate()

    def _validate(self) -> None:
        def number(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise BadParameter(f"{name} must be a number, got {value!r}", name)
            if value != value or value in (float("inf"), float("-inf")):
                raise BadParameter(f"{name} must be finite, got {value!r}", name)
            return float(value)

        def integer(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise BadParameter(f"{name} must be an integer, got {value!r}", name)
            return value

        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise BadParameter(f"{name} {message}", name)

        if self.max_tokens is not None:
            n = integer("max_tokens", self.max_tokens)
            if self.prompt_logprobs is None:
                check(n >= 1, "max_tokens", f"must be at least 1, got {n}")
            else:  # scoring a prompt: its logprobs, nothing generated
                check(n >= 0, "max_tokens", f"must be at least 0, got {n}")
        n = integer("n", self.n)
        check(1 <= n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {n}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                check(
                    0 <= integer(name, k) <= MAX_LOGPROBS,
                    name,
                    f"must be in [0, {MAX_LOGPROBS}], got {k}",
                )
        if self.response_format is not None and not isinstance(
            self.response_format, ResponseFormat
        ):
            raise BadParameter("response_format must be a ResponseFormat", "response_format")
        for t_id, b in self.logit_bias:
            check(integer("logit_bias", t_id) >= 0, "logit_bias", f"token ids must be >= 0: {t_id}")
            check(
                -100 <= number("logit_bias", b) <= 100, "logit_bias", f"must be in [-100, 100]: {b}"
            )
        t = number("temperature", self.temperature)
        check(t >= 0, "temperature", f"must be >= 0, got {t}")
        check(0 < number("top_p", self.top_p) <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        k = integer("top_k", self.top_k)
        check(k >= 0, "top_k", f"must be >= 0 (0 disables it), got {k}")
        check(
            0 <= number("min_p", self.min_p) <= 1, "min_p", f"must be in [0, 1], got {self.min_p}"
        )
        r = number("repetition_penalty", self.repetition_penalty)
        check(r > 0, "repetition_penalty", f"must be > 0, got {r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = number(name, getattr(self, name))
            check(-2 <= v <= 2, name, f"must be in [-2, 2], got {v}")
        if self.seed is not None:
            check(
                0 <= integer("seed", self.seed) < 2**63,
                "seed",
                f"must be in [0, 2**63), got {self.seed}",
            )
        check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
        )
        for s in self.stop:
            check(
                isinstance(s, str) and bool(s),
                "stop",
                f"strings must be non-empty strings, got {s!r}",
            )
            check(
                len(s) <= MAX_STOP_STRING_LEN,
                "stop",
                f"strings are limited to {MAX_STOP_STRING_LEN} characters",
            )
        for t_id in self.stop_token_ids:
            check(
                integer("stop_token_ids", t_id) >= 0, "stop_token_ids", f"must be >= 0, got {t_id}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n: its own seed (seed + index). The prompt's
        logprobs are choice 0's alone (the prompt is computed once)."""
        if index == 0:
            return self
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return replace(self, seed=seed, prompt_logprobs=None)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, end-of-turn, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # abort(request_id): a cancel or a client that went away
    TIMEOUT = "timeout"  # over the per-request time limit
    ERROR = "error"  # the engine failed this request


@dataclass
class Timings:
    """Wall-clock instants (time.monotonic()) of a request's life."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


class Request:
    """One generation: prompt, output so far, and how far its K/V is computed."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        session_id: str | None = None,
        use_prefix_cache: bool = True,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.session_id = session_id  # a conversation whose K/V stays pinned between turns
        self.use_prefix_cache = use_prefix_cache  # False: compute every prompt token
        self.cache_salt = cache_salt  # prefix-cache entries are shared only within a salt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens resolved against the context
        # Taking up another request's output (EngineRequest.replay_ids): fed back first.
        self.replay_ids: tuple[int, ...] = ()
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache; -1 = unknown
        self.num_tier_cached_tokens = 0  # ... of which loaded from the KV tier
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # one per full block of all_token_ids
        self.timings = Timings()
        # Every request gets its own generator, so that a seeded request draws the same
        # numbers whatever else shares its batch.
        self.generator = torch.Generator().manual_seed(
            params.seed if params.seed is not None else secrets.randbits(63)
        )
        self.detokenizer: IncrementalDetokenizer | None = None
        # Choices of one prompt (params.n > 1): outputs and aborts go by the group id (the
        # caller's id); choice 0 carries the others in `forks` until its prompt is computed,
        # when they take its blocks by reference (Scheduler.update).
        self.group_id = request_id
        self.index = 0
        self.forks: list[Request] = []
        self.logprobs: list[Logprob] = []  # one per output token, when params.logprobs
        # One per prompt token, the first None, when params.prompt_logprobs; filled as the
        # prompt's chunks are computed.
        self.prompt_logprobs: list[Logprob | None] = [None]
        self.grammar: Grammar | None = None  # the response_format's matcher

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
