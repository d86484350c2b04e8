"""/tokenize, /detokenize and /apply-template, with the real tokenizer (a fake engine
behind: nothing is generated)."""

import pytest
from starlette.testclient import TestClient

from app.chat.prompt import ChatPrompt, Message
from app.server.app import create_app
from tests.server.fake_engine import FakeEngine
from tests.server.testclient import for_testclient

ASK = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def client(tokenizer):
    with TestClient(create_app(engine=FakeEngine(tokenizer), server_config=for_testclient())) as c:
        yield c


def test_tokenize_a_prompt_and_back(client, tokenizer):
    r = client.post("/tokenize", json={"prompt": "Hello wörld"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == tokenizer.encode("Hello wörld", add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    assert [p["id"] for p in out["pieces"]] == out["tokens"]
    assert b"".join(bytes(p["bytes"]) for p in out["pieces"]).decode() == "Hello wörld"
    back = client.post("/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == "Hello wörld" and back["pieces"] == out["pieces"]


def test_tokenize_messages_is_the_servers_prompt(client, tokenizer):
    out = client.post("/tokenize", json={"messages": ASK}).json()
    assert out["tokens"] == ChatPrompt(tokenizer).render([Message("user", "Hello there")])
    text = client.post("/apply-template", json={"messages": ASK}).json()["prompt"]
    assert "Hello there" in text
    assert tokenizer.encode(text, add_special_tokens=False) == out["tokens"]
    bare = client.post("/apply-template", json={"messages": ASK, "add_generation_prompt": False})
    assert text.startswith(bare.json()["prompt"]) and len(bare.json()["prompt"]) < len(text)


def test_detokenize_shows_or_skips_special_tokens(client, tokenizer):
    ids = [tokenizer.eos_token_id, *tokenizer.encode("hi", add_special_tokens=False)]
    shown = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    skipped = client.post("/detokenize", json={"tokens": ids, "skip_special_tokens": True})
    assert shown == tokenizer.eos_token + "hi" and skipped.json()["prompt"] == "hi"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": ASK}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ("/tokenize", {"messages": ASK, "tools": [{"type": "function"}]}, "tools"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/apply-template", {"messages": []}, "messages"),
        ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/apply-template", {"messages": ASK, "model": "other"}, "model"),
    ],
)
def test_bad_input_is_a_clear_error(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert client.post("/tokenize", json={"prompt": "still fine"}).status_code == 200
