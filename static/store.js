// Conversations and settings, kept in localStorage so they survive reloads.
//
// A conversation: { id, title, messages: [{ role, content, stats?, error?, partial? }],
// updated }. The browser's copy is the history the server is sent every turn.

const KEY = "parley.v1";

function uid() {
  return crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random().toString(16).slice(2)}`;
}

export class Store {
  constructor() {
    let saved = null;
    try {
      saved = JSON.parse(localStorage.getItem(KEY) || "null");
    } catch {
      saved = null;
    }
    this.conversations = saved?.conversations ?? [];
    this.currentId = saved?.currentId ?? null;
    this.settings = {
      system: "",
      temperature: 0.7,
      top_p: 0.95,
      max_tokens: 512,
      theme: matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light",
      ...(saved?.settings ?? {}),
    };
    if (!this.current) this.create();
  }

  save() {
    localStorage.setItem(
      KEY,
      JSON.stringify({ conversations: this.conversations, currentId: this.currentId, settings: this.settings }),
    );
  }

  get current() {
    return this.conversations.find((c) => c.id === this.currentId) ?? null;
  }

  create() {
    const conversation = { id: uid(), title: "New chat", messages: [], updated: Date.now() };
    this.conversations.unshift(conversation);
    this.currentId = conversation.id;
    this.save();
    return conversation;
  }

  select(id) {
    if (this.conversations.some((c) => c.id === id)) {
      this.currentId = id;
      this.save();
    }
  }

  rename(id, title) {
    const c = this.conversations.find((x) => x.id === id);
    if (c && title.trim()) {
      c.title = title.trim().slice(0, 80);
      this.save();
    }
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = this.conversations[0]?.id ?? null;
    if (!this.current) this.create();
    this.save();
  }

  touch(conversation) {
    conversation.updated = Date.now();
    if (conversation.title === "New chat") {
      const first = conversation.messages.find((m) => m.role === "user");
      if (first) conversation.title = first.content.slice(0, 40) || "New chat";
    }
    this.save();
  }
}

export { uid };
