"""Request parameters from JSON, for both protocols: /ws `params` and /v1 request bodies
use the same names, the same types, the same defaults (SamplingParams') and the same
limits. A bad value raises BadParameter naming it; each protocol words the error its
own way (app.server.errors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from app.engine.errors import BadParameter
from app.engine.request import SamplingParams

# Every sampling parameter a client may set, and its JSON types.
PARAMS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "max_tokens": (int,),
    "seed": (int,),
    "stop": (str, list),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "repetition_penalty": (int, float),
    "ignore_eos": (bool,),  # an extension, for benchmarks: replies of exactly max_tokens
}


def sampling_params(
    values: Mapping[str, Any], max_tokens_limit: int, extra: Mapping[str, Any] | None = None
) -> SamplingParams:
    """SamplingParams from the parameters in `values` (keys of PARAMS; None = default).
    `max_tokens_limit` is the longest reply the context allows. `extra`: fields a
    protocol parsed itself (/v1's n, logprobs, response_format...). Raises BadParameter."""
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        kinds = PARAMS[key]
        if isinstance(value, bool) != (kinds == (bool,)) or not isinstance(value, kinds):
            expected = {bool: "a boolean", int: "an integer", str: "a string"}.get(
                kinds[0], "a number"
            )
            if kinds == (str, list):
                expected = "a string or a list of strings"
            raise BadParameter(f"{key} must be {expected}, not {type(value).__name__}", key)
        if isinstance(value, float) and not math.isfinite(value):
            raise BadParameter(f"{key} must be finite", key)
        kwargs[key] = value
    stop = kwargs.get("stop")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise BadParameter("stop must be a string or a list of strings", "stop")
    max_tokens = kwargs.get("max_tokens")
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise BadParameter(f"max_tokens is limited to {max_tokens_limit} here", "max_tokens")
    return SamplingParams(**kwargs, **(extra or {}))  # range checks: BadParameter naming it
