// Parley's chat page: conversations, streaming replies, stop / regenerate / edit.
//
// The browser keeps each conversation (store.js) and sends the whole history with every
// turn; the server keeps the conversation's K/V between turns, so only the new tokens
// cost anything. Model text is rendered by markdown.js as DOM nodes, never as HTML.

import { Connection } from "./connection.js";
import { renderMarkdown } from "./markdown.js";
import { Store, uid } from "./store.js";

const $ = (id) => document.getElementById(id);
const store = new Store();
const inflight = new Map(); // conversation id -> { turnId, message }
let renderQueued = false;

const wsUrl = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws`;
const connection = new Connection(wsUrl, {
  onState: showConnection,
  onFrame: (frame) => {
    if (frame.type === "error" && frame.id == null) console.warn("server:", frame.message);
  },
});

// -- conversations ------------------------------------------------------------------

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of store.conversations) {
    const li = document.createElement("li");
    li.className = c.id === store.currentId ? "active" : "";
    li.dataset.id = c.id;
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = c.title;
    name.title = c.title;
    const rename = button("✎", "link rename", "Rename", (e) => {
      e.stopPropagation();
      startRename(li, c);
    });
    const del = button("✕", "link delete", "Delete", (e) => {
      e.stopPropagation();
      if (confirm(`Delete “${c.title}”?`)) deleteConversation(c.id);
    });
    li.append(name, rename, del);
    li.addEventListener("click", () => {
      store.select(c.id);
      $("sidebar").classList.remove("open");
      renderAll();
    });
    list.append(li);
  }
}

function startRename(li, conversation) {
  const input = document.createElement("input");
  input.value = conversation.title;
  input.setAttribute("aria-label", "Conversation name");
  li.replaceChildren(input);
  input.focus();
  input.select();
  const finish = (keep) => {
    if (keep) store.rename(conversation.id, input.value);
    renderSidebar();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  input.addEventListener("click", (e) => e.stopPropagation());
}

function deleteConversation(id) {
  const turn = inflight.get(id);
  if (turn) connection.send({ type: "cancel", id: turn.turnId });
  inflight.delete(id);
  connection.send({ type: "delete", conversation_id: id });
  store.remove(id);
  renderAll();
}

// -- messages -----------------------------------------------------------------------

function renderMessages() {
  const box = $("messages");
  const conversation = store.current;
  box.replaceChildren();
  if (!conversation.messages.length) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.textContent = "Ask anything. Replies stream as they are written.";
    box.append(empty);
  }
  conversation.messages.forEach((m, index) => box.append(messageElement(conversation, m, index)));
  box.scrollTop = box.scrollHeight;
  updateComposer();
}

function messageElement(conversation, m, index) {
  const el = document.createElement("div");
  el.className = `message ${m.role}`;
  const live = inflight.get(conversation.id)?.message === m;
  if (live) el.classList.add("streaming");
  const bubble = document.createElement("div");
  bubble.className = "bubble";
  if (m.role === "assistant") bubble.append(renderMarkdown(m.content));
  else bubble.textContent = m.content;
  const meta = document.createElement("div");
  meta.className = "meta";
  if (m.role === "assistant") {
    const stats = document.createElement("span");
    stats.className = "stats";
    stats.textContent = statsText(m);
    meta.append(stats);
    if (m.error) {
      const err = document.createElement("span");
      err.className = "error";
      err.textContent = m.error;
      meta.append(err);
    }
    const last = index === conversation.messages.length - 1;
    if (last && !live) meta.append(button("↻ Regenerate", "link regenerate", "Regenerate", () => regenerate()));
  } else if (m.role === "user" && !inflight.has(conversation.id)) {
    meta.append(button("✎ Edit", "link edit", "Edit and resend", () => startEdit(el, conversation, index)));
  }
  el.append(bubble, meta);
  return el;
}

function statsText(m) {
  const s = m.stats;
  if (!s) return m.stopped ? "stopped" : "";
  const parts = [];
  if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  if (s.tokens_per_s != null) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
  if (s.prompt_tokens != null) parts.push(`reused ${s.cached_tokens} of ${s.prompt_tokens} prompt tokens`);
  if (m.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function startEdit(el, conversation, index) {
  const original = conversation.messages[index].content;
  const area = document.createElement("textarea");
  area.className = "edit";
  area.value = original;
  const save = button("Save & send", "primary save", "Save and resend", () => {
    const text = area.value.trim();
    if (!text) return;
    conversation.messages = conversation.messages.slice(0, index);
    conversation.messages.push({ role: "user", content: text });
    store.touch(conversation);
    startTurn(conversation);
  });
  const cancel = button("Cancel", "", "Cancel editing", () => renderMessages());
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.append(save, cancel);
  el.replaceChildren(area, meta);
  area.focus();
}

// Re-render the live message at most once per frame while tokens stream in.
function scheduleRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    renderMessages();
  });
}

// -- turns --------------------------------------------------------------------------

function send(text) {
  const conversation = store.current;
  if (inflight.has(conversation.id)) return;
  conversation.messages.push({ role: "user", content: text });
  store.touch(conversation);
  startTurn(conversation);
}

function regenerate() {
  const conversation = store.current;
  if (inflight.has(conversation.id)) return;
  while (conversation.messages.length && conversation.messages.at(-1).role === "assistant") {
    conversation.messages.pop();
  }
  if (!conversation.messages.length) return;
  startTurn(conversation);
}

function history(conversation) {
  return conversation.messages
    .filter((m) => m.content && (m.role === "user" || m.role === "assistant"))
    .map((m) => ({ role: m.role, content: m.content }));
}

function startTurn(conversation) {
  const messages = history(conversation);
  // A reply in flight keeps its turn id and the last seq shown, saved with its text: after a
  // reconnect or a reload, the page asks the server for the rest (see attach()).
  const reply = { role: "assistant", content: "", partial: true, lastSeq: -1 };
  conversation.messages.push(reply);
  const turnId = uid();
  const s = store.settings;
  const frame = {
    type: "chat",
    id: turnId,
    conversation_id: conversation.id,
    messages,
    params: { temperature: Number(s.temperature), top_p: Number(s.top_p), max_tokens: Number(s.max_tokens) },
  };
  if (s.system.trim()) frame.system = s.system.trim();
  reply.turnId = turnId;
  const turn = { turnId, message: reply };
  inflight.set(conversation.id, turn);
  const sent = connection.send(frame, (f) => onTurnFrame(conversation, turn, f), resumeFrame(conversation, reply));
  if (!sent) onTurnFrame(conversation, turn, { type: "error", message: "not connected: try again in a moment" });
  store.save();
  renderAll();
}

// The frame that re-attaches a reply in flight: every token after the last one shown.
function resumeFrame(conversation, reply) {
  return () => ({ type: "resume", id: reply.turnId, conversation_id: conversation.id, after_seq: reply.lastSeq });
}

// A reply that was streaming when the page was reloaded: ask for the rest once connected.
function attach(conversation, reply) {
  const turn = { turnId: reply.turnId, message: reply };
  inflight.set(conversation.id, turn);
  connection.expect(reply.turnId, (f) => onTurnFrame(conversation, turn, f), resumeFrame(conversation, reply));
}

function onTurnFrame(conversation, turn, frame) {
  const reply = turn.message;
  if (frame.type === "start") {
    reply.prompt_tokens = frame.prompt_tokens;
    reply.cached_tokens = frame.cached_tokens;
  } else if (frame.type === "token") {
    if (frame.seq <= reply.lastSeq) return; // sent again after a resume: shown already
    reply.lastSeq = frame.seq;
    reply.content += frame.text;
    saveSoon();
  } else if (frame.type === "done" || frame.type === "error") {
    reply.partial = false;
    delete reply.turnId;
    delete reply.lastSeq;
    if (frame.type === "done") {
      reply.stats = { ...frame.timings, prompt_tokens: frame.usage.prompt_tokens, cached_tokens: frame.usage.cached_tokens };
      reply.stopped = frame.finish_reason === "cancelled";
    } else if (frame.code === "unknown_id" || frame.code === "expired") {
      reply.error = "interrupted"; // a resume found the turn gone (the server lost it)
    } else {
      reply.error = frame.message;
    }
    inflight.delete(conversation.id);
    store.touch(conversation);
    renderSidebar();
    if (conversation.id === store.currentId) renderMessages();
    return;
  }
  if (conversation.id === store.currentId) scheduleRender();
}

let saveTimer = null;
function saveSoon() {
  // Keep the streaming reply in storage too: a reload mid-reply keeps what arrived.
  if (saveTimer) return;
  saveTimer = setTimeout(() => {
    saveTimer = null;
    store.save();
  }, 500);
}

function stop() {
  const turn = inflight.get(store.currentId);
  if (turn) connection.send({ type: "cancel", id: turn.turnId });
}

// -- chrome -------------------------------------------------------------------------

function showConnection(state, wait) {
  const el = $("connection");
  el.dataset.state = state;
  el.textContent = state === "open" ? "connected" : state === "reconnecting" && wait ? `reconnecting in ${Math.round(wait / 100) / 10}s` : state;
  updateComposer();
}

function updateComposer() {
  const busy = inflight.has(store.currentId);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("send").disabled = !connection.isOpen;
}

function button(label, className, title, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = label;
  b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

function applyTheme() {
  document.documentElement.dataset.theme = store.settings.theme;
}

function bindSettings() {
  const fields = { "system-prompt": "system", temperature: "temperature", "top-p": "top_p", "max-tokens": "max_tokens" };
  for (const [id, key] of Object.entries(fields)) {
    const input = $(id);
    input.value = store.settings[key];
    input.addEventListener("change", () => {
      store.settings[key] = input.type === "number" ? Number(input.value) : input.value;
      store.save();
    });
  }
}

function renderAll() {
  renderSidebar();
  renderMessages();
}

function init() {
  // A reply cut short by a reload is asked for again (the server keeps a turn for a while
  // after its socket drops); one that cannot be stays, marked as interrupted.
  for (const c of store.conversations) {
    for (const m of c.messages) {
      if (!m.partial) continue;
      if (m.turnId && m === c.messages.at(-1)) {
        attach(c, m);
      } else {
        m.partial = false;
        m.error = "interrupted";
      }
    }
  }
  applyTheme();
  bindSettings();
  const input = $("input");
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = input.value.trim();
    if (!text || !connection.isOpen || inflight.has(store.currentId)) return;
    input.value = "";
    input.style.height = "";
    send(text);
  });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  input.addEventListener("input", () => {
    input.style.height = "auto";
    input.style.height = `${input.scrollHeight}px`;
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    store.create();
    renderAll();
    input.focus();
  });
  $("toggle-theme").addEventListener("click", () => {
    store.settings.theme = store.settings.theme === "dark" ? "light" : "dark";
    store.save();
    applyTheme();
  });
  $("toggle-settings").addEventListener("click", () => {
    $("settings").hidden = !$("settings").hidden;
  });
  $("toggle-sidebar").addEventListener("click", () => $("sidebar").classList.toggle("open"));
  renderAll();
  input.focus();
  connection.start();
}

init();
