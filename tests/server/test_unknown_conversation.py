"""`content` continues a conversation the server holds; one it does not hold (it restarted
without a journal, or its store let the conversation go) is answered `unknown_conversation`
instead of a reply computed from the new message alone."""

from starlette.testclient import TestClient

from app.server import protocol as p
from app.server.app import ServerConfig, create_app
from app.server.chat_service import ChatConfig
from tests.server.fake_engine import FakeEngine
from tests.server.test_ws_fake import until_terminal
from tests.server.testclient import for_testclient


def first(id, conversation, text):
    return {"type": "chat", "id": id, "conversation_id": conversation,
            "messages": [{"role": "user", "content": text}]}  # fmt: skip


def more(id, conversation, text):
    return {"type": "chat", "id": id, "conversation_id": conversation, "content": text}


def app(tokenizer, **chat):
    config = ServerConfig(chat=ChatConfig(**chat), secret=b"k" * 32)
    return TestClient(
        create_app(engine=FakeEngine(tokenizer), server_config=for_testclient(config))
    )


def test_content_after_a_restart_is_refused_not_answered_without_its_history(tokenizer):
    with app(tokenizer) as before:
        before.get("/")
        cookies = dict(before.cookies)
        with before.websocket_connect("/ws") as ws:
            ws.send_json(first("t1", "c1", "a first question"))
            assert until_terminal(ws, ["t1"])["t1"][-1]["type"] == "done"
    with app(tokenizer) as after:  # the same browser, a new process
        after.cookies.update(cookies)
        with after.websocket_connect("/ws") as ws:
            ws.send_json(more("t2", "c1", "and a second"))
            (err,) = until_terminal(ws, ["t2"])["t2"]
            assert err["type"] == "error" and err["code"] == p.UNKNOWN_CONVERSATION
            assert "messages" in err["message"] and not err["retryable"]
            # Told so, the client sends the whole history: that is answered.
            history = [{"role": "user", "content": "a first question"},
                       {"role": "assistant", "content": "reply"},
                       {"role": "user", "content": "and a second"}]  # fmt: skip
            ws.send_json({**first("t3", "c1", ""), "messages": history})
            assert until_terminal(ws, ["t3"])["t3"][-1]["type"] == "done"
            ws.send_json(more("t4", "c1", "and a third"))  # held now: content is fine
            assert until_terminal(ws, ["t4"])["t4"][-1]["type"] == "done"


def test_content_for_a_conversation_the_store_let_go_is_refused(tokenizer):
    with app(tokenizer, max_conversations=2) as client:
        client.get("/")
        with client.websocket_connect("/ws") as ws:
            for i in range(3):  # c0 is the least recently active: it goes
                ws.send_json(first(f"t{i}", f"c{i}", "hi"))
                assert until_terminal(ws, [f"t{i}"])[f"t{i}"][-1]["type"] == "done"
            ws.send_json(more("again", "c0", "and then?"))
            (err,) = until_terminal(ws, ["again"])["again"]
            assert err["code"] == p.UNKNOWN_CONVERSATION
            ws.send_json(more("fine", "c2", "and then?"))
            assert until_terminal(ws, ["fine"])["fine"][-1]["type"] == "done"
