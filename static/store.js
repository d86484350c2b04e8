// Conversations and settings, kept in localStorage so they survive reloads; export and
// import as JSON; search.
//
// A conversation: { id, title, nodes (tree.js), settings, updated }. Its path of messages
// is the history the server is sent every turn; each has its own settings (system prompt
// and sampling parameters), which start as the defaults for new chats.

import { emptyTree, fromMessages, path } from "./tree.js";

const KEY = "parley.v2";
const OLD_KEY = "parley.v1";
export const EXPORT_VERSION = 2;

// The settings a new chat starts with, until the user saves others ("Use for new chats").
export const BUILTIN_SETTINGS = { system: "", temperature: 0.7, top_p: 0.95, max_tokens: 512 };

export function uid() {
  return crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random().toString(16).slice(2)}`;
}

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(KEY) || "null");
    if (saved) return saved;
    const old = JSON.parse(localStorage.getItem(OLD_KEY) || "null");
    if (old) return migrate(old);
  } catch {
    // unreadable storage: start afresh
  }
  return null;
}

// The v1 page kept a flat list of messages and one set of settings for every chat.
function migrate(old) {
  const { system, temperature, top_p, max_tokens, theme } = old.settings ?? {};
  const settings = { ...BUILTIN_SETTINGS, ...clean({ system, temperature, top_p, max_tokens }) };
  return {
    conversations: (old.conversations ?? []).map((c) => ({
      id: c.id,
      title: c.title,
      updated: c.updated,
      nodes: fromMessages(c.messages ?? [], uid),
      settings: { ...settings },
    })),
    currentId: old.currentId,
    newChatSettings: settings,
    theme,
  };
}

function clean(values) {
  return Object.fromEntries(Object.entries(values).filter(([, v]) => v !== undefined));
}

export class Store {
  constructor() {
    const saved = load();
    this.conversations = saved?.conversations ?? [];
    this.currentId = saved?.currentId ?? null;
    this.newChatSettings = saved?.newChatSettings ?? { ...BUILTIN_SETTINGS };
    this.theme = saved?.theme ?? (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light");
    if (!this.current) this.create();
  }

  save() {
    const { conversations, currentId, newChatSettings, theme } = this;
    localStorage.setItem(KEY, JSON.stringify({ conversations, currentId, newChatSettings, theme }));
  }

  get current() {
    return this.conversations.find((c) => c.id === this.currentId) ?? null;
  }

  find(id) {
    return this.conversations.find((c) => c.id === id) ?? null;
  }

  create() {
    const conversation = {
      id: uid(),
      title: "New chat",
      nodes: emptyTree(),
      settings: { ...this.newChatSettings },
      updated: Date.now(),
    };
    this.conversations.unshift(conversation);
    this.currentId = conversation.id;
    this.save();
    return conversation;
  }

  // "+ New chat": the empty chat already there if there is one, else a new one.
  openEmpty() {
    const empty = this.conversations.find((c) => !path(c).length);
    if (empty) {
      this.select(empty.id);
      return empty;
    }
    return this.create();
  }

  select(id) {
    if (this.find(id)) {
      this.currentId = id;
      this.save();
    }
  }

  rename(id, title) {
    const c = this.find(id);
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
      const first = path(conversation).find((m) => m.role === "user");
      if (first) conversation.title = first.content.slice(0, 40) || "New chat";
    }
    this.save();
  }

  // Conversations whose title or any message (in any version) contains `query`.
  search(query) {
    const q = query.trim().toLowerCase();
    if (!q) return this.conversations;
    return this.conversations.filter(
      (c) =>
        c.title.toLowerCase().includes(q) ||
        Object.values(c.nodes).some((n) => typeof n.content === "string" && n.content.toLowerCase().includes(q)),
    );
  }

  exportJSON() {
    const conversations = this.conversations.map((c) => {
      const nodes = {};
      for (const [id, n] of Object.entries(c.nodes)) {
        const { turnId, lastSeq, partial, ...kept } = n; // a turn in flight is not exported
        nodes[id] = kept;
      }
      return { id: c.id, title: c.title, updated: c.updated, settings: c.settings, nodes };
    });
    return JSON.stringify({ parley: EXPORT_VERSION, conversations }, null, 2);
  }

  // Add the conversations of an export (ours, or { title, messages: [{ role, content }] }
  // lists); returns how many. Throws Error with a message fit to show.
  importJSON(text) {
    let data;
    try {
      data = JSON.parse(text);
    } catch {
      throw new Error("that file is not JSON");
    }
    const list = Array.isArray(data) ? data : data?.conversations;
    if (!Array.isArray(list)) throw new Error("no conversations in that file");
    const added = list.map((c, i) => importOne(c, i));
    for (const c of added) {
      if (this.find(c.id)) c.id = uid();
    }
    this.conversations.unshift(...added);
    this.currentId = added[0]?.id ?? this.currentId;
    this.save();
    return added.length;
  }
}

const ROLES = new Set(["user", "assistant"]);

function importOne(c, i) {
  if (!c || typeof c !== "object") throw new Error(`conversation ${i + 1} is not an object`);
  let nodes;
  if (c.nodes && typeof c.nodes === "object" && c.nodes.root) {
    nodes = {};
    for (const [id, n] of Object.entries(c.nodes)) {
      // Each child names its parent back: no cycles, no message in two places.
      const ok =
        n && n.id === id && Array.isArray(n.children) &&
        n.children.every((k) => c.nodes[k]?.parent === id) &&
        (id === "root" || (ROLES.has(n.role) && typeof n.content === "string" && n.parent in c.nodes));
      if (!ok) throw new Error(`conversation ${i + 1}: message ${id} is malformed`);
      const { turnId, lastSeq, partial, ...kept } = n; // nothing of it is in flight here
      const active = Number.isInteger(n.active) && n.active >= 0 ? n.active : 0;
      nodes[id] = { ...kept, active };
    }
  } else if (Array.isArray(c.messages)) {
    const messages = c.messages.filter((m) => ROLES.has(m?.role) && typeof m.content === "string");
    nodes = fromMessages(messages.map((m) => ({ role: m.role, content: m.content })), uid);
  } else {
    throw new Error(`conversation ${i + 1} has no messages`);
  }
  return {
    id: typeof c.id === "string" ? c.id : uid(),
    title: typeof c.title === "string" && c.title ? c.title.slice(0, 80) : "Imported chat",
    updated: Number(c.updated) || Date.now(),
    settings: { ...BUILTIN_SETTINGS, ...(c.settings && typeof c.settings === "object" ? c.settings : {}) },
    nodes,
  };
}
