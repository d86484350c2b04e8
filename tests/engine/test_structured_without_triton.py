"""Structured output on the CPU never needs triton (which xgrammar requires on Linux
x86-64 for its CUDA mask kernel, ~1 GB installed): in a process where triton cannot be
imported, a JSON Schema still bounds the reply, and triton was never asked for.
docs/install.md: a CPU install may `pip uninstall triton`."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    asked = []

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "triton":
                asked.append(name)
                raise ImportError("triton is not installed")

    sys.meta_path.insert(0, NoTriton())
    from app.config import ModelConfig
    from app.engine.engine_request import EngineRequest
    from app.engine.request import ResponseFormat, SamplingParams
    from app.model.loader import load_model
    from tests.tiny import tiny_engine

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
              "n": {"enum": [1, 2, 3]}}, "required": ["color", "n"],
              "additionalProperties": False}
    engine = tiny_engine(load_model(ModelConfig()).tokenizer)
    fmt = ResponseFormat("json_schema", json.dumps(schema))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, response_format=fmt)
    engine.add_request(EngineRequest(list(range(200, 230)), params, "j"))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.new_text
    print(json.dumps({"text": text, "asked": asked}))
    """
)


def test_a_schema_bounds_the_reply_where_triton_cannot_be_imported():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=600, check=True)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    reply = json.loads(result["text"])
    assert reply["color"] in ("red", "green") and reply["n"] in (1, 2, 3)
    assert result["asked"] == []  # nothing on the CPU path even tried
