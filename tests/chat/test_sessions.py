"""ConversationStore: namespaces per tenant, owners, and dropping the oldest idle one."""

from app.chat.sessions import ConversationStore


def test_store_drops_the_oldest_idle_conversation_when_full():
    dropped = []
    store = ConversationStore(dropped.append, max_conversations=2)
    a = store.get("", "a", "me")
    a.turn = "busy"  # mid-turn: never dropped
    store.get("", "b", "me")
    store.get("", "c", "me")
    assert dropped == ["b"]
    assert store.find("", "a") is a and store.find("", "c") is not None
    store.delete(store.find("", "c"))
    assert dropped == ["b", "c"] and store.find("", "c") is None


def test_tenants_are_separate_namespaces():
    dropped = []
    store = ConversationStore(dropped.append)
    mine = store.get("acme", "chat-1", "tenant:acme")
    theirs = store.get("globex", "chat-1", "tenant:globex")
    assert mine is not theirs and mine.key != theirs.key  # separate engine sessions too
    assert store.find("acme", "chat-1").owner == "tenant:acme"
    store.delete(theirs)
    assert dropped == [theirs.key] and store.find("acme", "chat-1") is mine


def test_an_existing_conversation_keeps_its_first_owner():
    store = ConversationStore(lambda key: None)
    store.get("", "c", "client:a")
    assert store.get("", "c", "client:b").owner == "client:a"  # the caller must refuse b
