"""What the chat page is told when it loads: the model's name, its context window (the
page's gauge) and the defaults of every sampling parameter a turn may set (shown in the
settings, so that a field left empty says what the server will use)."""

from __future__ import annotations

import dataclasses
from typing import Any

from app.engine.outputs import ModelInfo
from app.engine.request import SamplingParams
from app.server.params import PARAMS


def sampling_defaults() -> dict[str, Any]:
    """Each /ws parameter's default, as SamplingParams has it (None: no limit or no seed)."""
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    out: dict[str, Any] = {}
    for name in PARAMS:
        f = fields[name]
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def page_context(info: ModelInfo) -> dict[str, Any]:
    return {
        "model_name": info.name,
        "page_config": {  # as JSON in the page (Jinja's tojson escapes it for HTML)
            "model": info.name,
            "context_window": info.max_model_len,
            "defaults": sampling_defaults(),
        },
    }
