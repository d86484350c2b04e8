"""Tool calls and reasoning on every surface (/v1/chat/completions, /v1/responses,
/v1/messages), with chat templates that render tools and think, set in the test.

A tiny random model behind a real server, spoken to by the official clients, shows a
forced tool_choice: the grammar engine makes even a model that knows nothing of tools
write one call of the named tool, whose argument deltas add up to its arguments. A fake
engine with canned replies shows the formats parsed as they stream (fast)."""

import copy
import json

import anthropic
import openai
import pytest
from starlette.testclient import TestClient

from app.engine.async_engine import AsyncEngine
from app.server.app import create_app
from tests.e2e.live_server import live_server
from tests.server.fake_engine import FakeEngine
from tests.server.testclient import for_testclient
from tests.tiny import tiny_engine

# Hermes-style: what Qwen 2.5 / Qwen 3 templates teach (ChatML, tools in the system turn).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools, inside <tool_call></tool_call>"
    " tags:\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- endif %}{% endif %}"
)
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def with_template(tokenizer, template=HERMES_TEMPLATE):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


# -- a tiny model, a real server, the official clients -----------------------------------


@pytest.fixture(scope="module")
def tiny_server(tokenizer):
    engine = AsyncEngine(tiny_engine(with_template(tokenizer), num_blocks=512))
    with live_server(create_app(engine=engine)) as s:
        yield s


def test_forced_call_on_chat_completions_streams_argument_deltas(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    full = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER],
        tool_choice=choice,
        max_tokens=40,
        temperature=0,
    )
    [call] = full.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and full.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments)["city"] in CITY["properties"]["city"]["enum"]
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert len(deltas) > 2  # the arguments came in pieces, as they were sampled
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_forced_call_on_responses(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    out = client.responses.create(
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    )
    [item] = out.output
    assert item.type == "function_call" and item.name == "get_weather"
    args = json.loads(item.arguments)
    events = list(
        client.responses.create(
            input="Weather in Paris?",
            tools=[tool],
            tool_choice="required",
            max_output_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and json.loads("".join(deltas)) == args
    # The call's result goes back as an item; the template renders the whole exchange.
    follow = client.responses.create(
        previous_response_id=out.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}],
        tools=[tool],
        max_output_tokens=5,
        temperature=0,
    )
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_forced_call_on_messages(tiny_server):
    client = anthropic.Anthropic(base_url=tiny_server.url, api_key="x", max_retries=0)
    tool = {"name": "get_weather", "input_schema": CITY}
    out = client.messages.create(
        model="tiny",
        max_tokens=40,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    [block] = out.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input["city"] in CITY["properties"]["city"]["enum"]
    assert out.stop_reason == "tool_use"
    with client.messages.stream(
        model="tiny", max_tokens=40, messages=ASK, tools=[tool], tool_choice={"type": "any"}
    ) as stream:
        partial = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        final = stream.get_final_message()
    assert len(partial) > 1 and final.content[0].input == json.loads("".join(partial))


# -- canned replies: each format as it streams ---------------------------------------------

HERMES_REPLY = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
THINK_REPLY = "<think> The user wants a fruit. </think> Banana."


@pytest.fixture
def fake_client(tokenizer, request):
    reply, template = request.param
    fake = FakeEngine(with_template(tokenizer, template), reply=reply)
    with TestClient(create_app(engine=fake, server_config=for_testclient())) as c:
        c.fake = fake
        yield c


def sse(response) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")
    ]


@pytest.mark.parametrize("fake_client", [(HERMES_REPLY, HERMES_TEMPLATE)], indirect=True)
def test_auto_calls_on_responses_and_messages(fake_client):
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    out = fake_client.post("/v1/responses", json={"input": "hi", "tools": [tool]}).json()
    assert [i["type"] for i in out["output"]] == ["message", "function_call"]
    assert out["output"][0]["content"][0]["text"] == "Let me check."
    assert json.loads(out["output"][1]["arguments"]) == {"city": "Paris"}
    body = {"input": "hi", "tools": [tool], "stream": True}
    events = sse(fake_client.post("/v1/responses", json=body))
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and json.loads("".join(deltas)) == {"city": "Paris"}
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.added", 3)

    anth = {
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "get_weather", "input_schema": CITY}],
    }
    msg = fake_client.post("/v1/messages", json=anth).json()
    assert [b["type"] for b in msg["content"]] == ["text", "tool_use"]
    assert msg["content"][1]["input"] == {"city": "Paris"} and msg["stop_reason"] == "tool_use"
    events = sse(fake_client.post("/v1/messages", json={**anth, "stream": True}))
    partial = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert len(partial) > 1 and json.loads("".join(partial)) == {"city": "Paris"}
    # A tool_use and its tool_result go back through the template.
    history = [
        *anth["messages"],
        {"role": "assistant", "content": msg["content"]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "content": "sunny", "tool_use_id": msg["content"][1]["id"]}
            ],
        },
    ]
    again = fake_client.post("/v1/messages", json={**anth, "messages": history})
    assert again.status_code == 200, again.text
    [prompt] = list(fake_client.fake.prompts.values())[-1:]
    assert "sunny" in fake_client.fake.tokenizer.decode(prompt)


@pytest.mark.parametrize("fake_client", [(THINK_REPLY, HERMES_TEMPLATE)], indirect=True)
def test_reasoning_on_every_surface(fake_client):
    chat = fake_client.post("/v1/chat/completions", json={"messages": ASK}).json()
    message = chat["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants a fruit."
    assert message["content"] == "Banana."
    events = sse(fake_client.post("/v1/chat/completions", json={"messages": ASK, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants a fruit."
    assert "".join(d.get("content") or "" for d in deltas) == "Banana."

    out = fake_client.post("/v1/responses", json={"input": "hi"}).json()
    assert [i["type"] for i in out["output"]] == ["reasoning", "message"]
    assert out["output"][0]["content"][0]["text"] == "The user wants a fruit."
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] > 0

    msg = fake_client.post("/v1/messages", json={"max_tokens": 50, "messages": ASK}).json()
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"]
    assert msg["content"][1]["text"] == "Banana."

    # The template offers enable_thinking: reasoning_effort and thinking reach it.
    fake_client.post("/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "none"})
    [prompt] = list(fake_client.fake.prompts.values())[-1:]
    assert fake_client.fake.tokenizer.decode(prompt).endswith("<think>\n\n</think>")
    first = next(iter(fake_client.fake.prompts.values()))
    assert "</think>" not in fake_client.fake.tokenizer.decode(first)
    thinking = {"type": "enabled", "budget_tokens": 100}
    r = fake_client.post(
        "/v1/messages", json={"max_tokens": 5, "messages": ASK, "thinking": thinking}
    )
    assert r.status_code == 200, r.text
    r = fake_client.post("/v1/responses", json={"input": "hi", "reasoning": {"effort": "loud"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning"
