"""response_format as a token mask in the batched sampler: even a random model's reply
parses and validates when the schema bounds it; free requests in the same step are not
constrained."""

import json
from dataclasses import replace

import jsonschema
import pytest

from app.engine.engine_request import EngineRequest
from app.engine.errors import BadParameter
from app.engine.request import ResponseFormat, SamplingParams
from tests.tiny import tiny_engine

# Every value comes from a finite set: the grammar alone must bring the reply to its end.
BOUNDED = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "sizes": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
        "point": {
            "type": "object",
            "properties": {"x": {"enum": [0, 1]}, "y": {"enum": [0, 1]}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    "required": ["color", "ok", "sizes", "point"],
    "additionalProperties": False,
}


def fmt(schema=BOUNDED) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(schema))


def texts(engine) -> dict[tuple[str, int], tuple[str, str]]:
    out: dict[tuple[str, int], list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            entry = out.setdefault((o.request_id, o.index), ["", None])
            entry[0] += o.new_text
            if o.finished:
                entry[1] = str(o.finish_reason)
        engine.check_integrity()
    return {k: (v[0], v[1]) for k, v in out.items()}


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_constrained_and_free_requests_share_a_step(tokenizer, temperature):
    engine = tiny_engine(tokenizer)
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=120, n=2)
    engine.add_request(
        EngineRequest(list(range(200, 230)), replace(params, response_format=fmt()), "json")
    )
    engine.add_request(EngineRequest(list(range(200, 230)), params, "free"))
    got = texts(engine)
    for i in range(2):
        text, reason = got[("json", i)]
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), BOUNDED)
    free = got[("free", 0)][0]
    with pytest.raises(ValueError):
        json.loads(free)


def test_json_object_gives_an_object(tokenizer):
    engine = tiny_engine(tokenizer)
    p = SamplingParams(temperature=0, max_tokens=40, response_format=ResponseFormat("json_object"))
    engine.add_request(EngineRequest(list(range(300, 320)), p, "o"))
    text, reason = texts(engine)[("o", 0)]
    assert text.startswith("{")
    if reason == "stop":  # a random model may wander in a free string until max_tokens
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "schema",
    ['{"type": "object", "properties": {"a": {"type": "nonsense"}}}', "{not json", "[1, 2]"],
)
def test_a_schema_the_library_rejects_is_a_bad_parameter(tokenizer, schema):
    engine = tiny_engine(tokenizer)
    with pytest.raises(BadParameter) as err:
        engine.make_request(EngineRequest([1, 2, 3], SamplingParams(response_format=ResponseFormat(
            "json_schema", schema))))  # fmt: skip
    assert err.value.name == "response_format"
    assert "response_format" in str(err.value)
