"""/v1 request fields: each honoured, ignored for a stated reason, or refused naming it;
n choices, logprobs, echo and tools in the response shapes (fake engine: fast)."""

import copy
import json
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from app.server.app import create_app
from app.server.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS
from tests.server.fake_engine import FakeEngine
from tests.server.testclient import for_testclient

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture
def fake(tokenizer):
    return FakeEngine(tokenizer, reply="one two three")


@pytest.fixture
def client(fake):
    with TestClient(create_app(engine=fake, server_config=for_testclient())) as c:
        yield c


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": ASK, **body})


def complete(client, **body):
    return client.post("/v1/completions", json={"prompt": "Hello there", **body})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"store": True}, "store"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"n": 0}, "n"),
    ],
)
def test_chat_refuses_naming_the_field(client, body, param):
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 6}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),  # a chat field
    ],
)
def test_completions_refuse_naming_the_field(client, body, param):
    r = complete(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_ignored_fields_are_accepted(client):
    body = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "prompt_cache_key": "abc", "safety_identifier": "s", "modalities": ["text"],
            "prediction": {"type": "content", "content": "x"}, "parallel_tool_calls": False,
            "tool_choice": "none", "stream_options": None}  # fmt: skip
    assert chat(client, **body).status_code == 200
    assert complete(client, user="u1", best_of=2, n=2).status_code == 200


def test_the_docs_table_lists_every_field():
    doc = Path(__file__).resolve().parents[2] / "docs" / "openai_api.md"
    text = doc.read_text()
    section = text[text.index("## Request fields") :]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*?) \|", section, flags=re.M))
    for name in {**CHAT_FIELDS, **COMPLETION_FIELDS}:
        assert name in rows, f"docs/openai_api.md's field table misses {name}"


def test_n_choices_non_streaming_and_streaming(client, fake):
    r = chat(client, n=3, max_tokens=5).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "one two three" for c in r["choices"])
    prompt = r["usage"]["prompt_tokens"]
    assert r["usage"]["completion_tokens"] == 9 and r["usage"]["total_tokens"] == prompt + 9
    events = stream(client, "/v1/chat/completions", {"messages": ASK, "n": 3,
                    "stream_options": {"include_usage": True}})  # fmt: skip
    chunks = [e for e in events if e["choices"]]
    assert all(len(e["choices"]) == 1 and "index" in e["choices"][0] for e in chunks)
    for i in range(3):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content") or "" for c in mine) == "one two three"
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
    assert events[-1]["usage"]["completion_tokens"] == 9


def stream(client, path, body):
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_chat_logprobs_shape(client):
    r = chat(client, logprobs=True, top_logprobs=2).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == "one two three"
    assert all(e["logprob"] == -0.5 and len(e["top_logprobs"]) == 2 for e in content)
    assert bytes(content[1]["bytes"]).decode() == content[1]["token"]
    assert chat(client).json()["choices"][0]["logprobs"] is None


def test_completion_echo_scoring_with_max_tokens_0(client, tokenizer):
    r = complete(client, echo=True, max_tokens=0, logprobs=1).json()
    choice = r["choices"][0]
    assert choice["text"] == "Hello there" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [-0.5] * (len(ids) - 1)
    assert "".join(lp["tokens"]) == "Hello there"
    assert lp["text_offset"][0] == 0 and r["usage"]["completion_tokens"] == 0
    three = complete(client, echo=True, max_tokens=0, logprobs=0, n=3).json()["choices"]
    assert [c["index"] for c in three] == [0, 1, 2]
    assert complete(client, echo=True, max_tokens=3).json()["choices"][0]["text"] == (
        "Hello thereone two three"
    )


TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t.function.name }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


@pytest.fixture
def tool_client(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    reply = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    fake = FakeEngine(tok, reply=reply)
    with TestClient(create_app(engine=fake, server_config=for_testclient())) as c:
        c.fake = fake
        yield c


def test_tools_render_and_calls_parse_where_the_template_has_tools(tool_client, tokenizer):
    r = chat(tool_client, tools=[WEATHER]).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    [prompt] = tool_client.fake.prompts.values()
    assert "get_weather" in tokenizer.decode(prompt)
    events = stream(tool_client, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER]})
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    # The call's id and name first, then its arguments as deltas that add up to them.
    assert [c["function"]["name"] for c in calls if "name" in c["function"]] == ["get_weather"]
    assert calls[0]["id"] and calls[0]["function"]["arguments"] == ""
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args) == {"city": "Paris"} and len(calls) > 2
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == "Sure."
    reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]]
    assert reasons == ["tool_calls"]
    # A follow-up with the call and its result goes through the template.
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    assert chat(tool_client, messages=history, tools=[WEATHER]).status_code == 200


def test_a_forced_tool_call_is_a_schema_constrained_reply(tool_client):
    r = chat(tool_client, tools=[WEATHER],
             tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    assert r.status_code == 200
    [params] = tool_client.fake.params.values()
    schema = json.loads(params.response_format.schema)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]
    bad = chat(tool_client, tools=[WEATHER], tool_choice={"type": "function",
               "function": {"name": "nope"}})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
