"""A conversation belongs to whoever started it: another client cannot continue it from
the server's memory, hijack it with a history of its own, or delete it; tenants are
separate namespaces; a turn's busy mark is its own."""

import hashlib
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from app.config import CacheConfig, EngineConfig
from app.engine.engine import LLMEngine
from app.server import protocol as p
from app.server.app import ServerConfig, create_app
from app.server.chat_service import ChatService
from app.server.security import Principal, parse_keys_file
from tests.server.fake_engine import FakeEngine
from tests.server.test_ws_fake import text_of, until_terminal
from tests.server.test_ws_real import Recording
from tests.server.testclient import for_testclient

SECRET = "My secret code is 4242. Remember it."


def content(id, conversation, text, first=False):
    """A turn: the first of a conversation gives its history (`content` continues one the
    server holds)."""
    said = {"messages": [{"role": "user", "content": text}]} if first else {"content": text}
    return {"type": "chat", "id": id, "conversation_id": conversation, **said,
            "params": {"temperature": 0, "max_tokens": 16}}  # fmt: skip


def test_another_client_can_neither_read_nor_hijack_nor_delete(smollm):
    engine = Recording(LLMEngine(EngineConfig(cache=CacheConfig(64 << 20)), smollm))
    # Two clients that keep no cookies: each socket is a client of its own.
    with TestClient(create_app(engine=engine, server_config=for_testclient())) as client:
        client.cookies.clear()
        with client.websocket_connect("/ws") as a, client.websocket_connect("/ws") as m:
            a.send_json(content("t1", "victim-conv", SECRET, first=True))
            assert until_terminal(a, ["t1"])["t1"][-1]["type"] == "done"
            asked = len(engine.prompts)

            # The scenario: only the id is known.
            m.send_json(content("t1", "victim-conv", "What was my secret code?"))
            (err,) = until_terminal(m, ["t1"])["t1"]
            assert err["type"] == "error" and err["code"] == p.FORBIDDEN
            assert "another client" in err["message"] and "4242" not in err["message"]
            # A history of its own would replace Alice's pin and her remembered history.
            m.send_json({"type": "chat", "id": "t2", "conversation_id": "victim-conv",
                         "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
            assert until_terminal(m, ["t2"])["t2"][-1]["code"] == p.FORBIDDEN
            m.send_json({"type": "delete", "conversation_id": "victim-conv"})
            assert m.receive_json()["code"] == p.FORBIDDEN
            assert len(engine.prompts) == asked  # nothing of Mallory's reached the engine

            # Alice's conversation is intact: history and pinned K/V.
            a.send_json(content("t2", "victim-conv", "What was my secret code?"))
            frames = until_terminal(a, ["t2"])["t2"]
            start, done = frames[0], frames[-1]
            assert done["type"] == "done"
            assert start["cached_tokens"] > len(smollm.tokenizer.encode(SECRET))
            assert smollm.tokenizer.decode(engine.prompts[-1]).count("4242") == 1

            # Mallory's own conversation works, and starts from nothing of Alice's.
            m.send_json(content("t3", "mallory-conv", "What was my secret code?", first=True))
            frames = until_terminal(m, ["t3"])["t3"]
            assert frames[-1]["type"] == "done"
            assert "4242" not in smollm.tokenizer.decode(engine.prompts[-1])
            assert "4242" not in text_of(frames)


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(
        "# tenant key\nacme acme-key\nglobex sha256:"
        "7a1b0d8c40e2ac9d79c1f3c9f6b7a52f8b0d1f3a7e6c2b9d4a0f1e2d3c4b5a69\n"
    )
    return path


def test_keys_file_keeps_digests_only(keys_file):
    keys = parse_keys_file(keys_file)
    assert set(keys) == {"acme", "globex"} and all(len(d) == 32 for d in keys.values())
    assert b"acme-key" not in b"".join(keys.values())


@pytest.mark.parametrize(
    "text",
    ["acme", "acme k1 k2", "acme k1\nacme k2", "acme sha256:zz"],
)
def test_bad_keys_files_are_refused(tmp_path, text):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError):
        parse_keys_file(path)


@pytest.mark.parametrize("isolate", [False, True])
def test_two_tenants_with_the_same_conversation_id_do_not_meet(tokenizer, isolate):
    from app.server.chat_service import ChatConfig

    keys = {name: hashlib.sha256(f"{name}-key".encode()).digest() for name in ("acme", "globex")}
    fake = FakeEngine(tokenizer, reply="fine thanks")
    config = ServerConfig(api_keys=keys, chat=ChatConfig(isolate_prefix_cache=isolate))
    with TestClient(create_app(engine=fake, server_config=for_testclient(config))) as client:
        requests = {}
        for tenant, history in (("acme", "Acme's first words"), ("globex", "Globex here")):
            auth = {"Authorization": f"Bearer {tenant}-key"}
            before = set(fake.prompts)
            with client.websocket_connect("/ws", headers=auth) as ws:
                for i, text in enumerate([history, "And then?"]):
                    ws.send_json(content(f"t{i}", "chat-1", text, first=i == 0))
                    assert until_terminal(ws, [f"t{i}"])[f"t{i}"][-1]["type"] == "done"
            requests[tenant] = [rid for rid in fake.prompts if rid not in before]
        acme, globex = requests["acme"], requests["globex"]
        assert {fake.sessions[r] for r in acme}.isdisjoint(fake.sessions[r] for r in globex)
        second = tokenizer.decode(fake.prompts[globex[1]])
        assert "Globex here" in second and "Acme" not in second
        salts = {fake.salts[r] for r in acme + globex}
        assert salts == ({"acme", "globex"} if isolate else {None})


def test_a_late_end_of_an_old_turn_leaves_a_newer_turns_mark(tokenizer):
    """Turn ids are the client's; the busy mark belongs to one turn (two sockets of one
    user may both call their turn "t")."""
    chat = ChatService(FakeEngine(tokenizer))
    me = Principal("", "client:me")

    def frame(turn_id):
        return p.parse_frame(
            f'{{"type": "chat", "id": "{turn_id}", "conversation_id": "c", '
            '"messages": [{"role": "user", "content": "hi"}]}',
            100,
        )

    first = chat.begin_turn(frame("t"), me)
    chat.end_turn(first, "hello", None)
    second = chat.begin_turn(frame("t"), me)  # the other tab, same turn id
    chat.end_turn(first, None, None)  # a late, second end of the first turn
    with pytest.raises(p.ProtocolError) as busy:
        chat.begin_turn(frame("u"), me)
    assert busy.value.code == p.CONVERSATION_BUSY
    chat.end_turn(second, "hi again", None)
    assert chat.begin_turn(frame("u"), me).conversation.turn is not None
