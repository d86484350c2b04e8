// Parley's chat page: conversations with branches, streaming replies, per-chat settings.
//
// The browser keeps each conversation (store.js, tree.js) and sends the path shown with
// every turn; the server keeps the conversation's K/V between turns, so only the new tokens
// cost anything, and drops the oldest turns when the model's window is full (the thread
// says so). Replies are rendered by the server (markdown.js), which escapes model HTML.

import { Connection } from "./connection.js";
import { Markdown } from "./markdown.js";
import { SettingsPanel, turnSettings } from "./settings.js";
import { Store, uid } from "./store.js";
import { Thread, button } from "./thread.js";
import { ROOT, append, path, pathTo, remove, shift } from "./tree.js";

const $ = (id) => document.getElementById(id);
const config = JSON.parse($("page-config").textContent);
const store = new Store();
const markdown = new Markdown();
const inflight = new Map(); // conversation id -> { turnId, message }
let liveQueued = false;

const wsUrl = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws`;
const connection = new Connection(wsUrl, {
  onState: showConnection,
  onFrame: (frame) => {
    if (frame.type === "error" && frame.id == null) console.warn("server:", frame.message);
  },
});

const thread = new Thread($("messages"), $("jump"), markdown, {
  idle: () => !inflight.has(store.currentId),
  edit: (m, text) => {
    const conversation = store.current;
    startTurn(conversation, append(conversation, m.parent, { role: "user", content: text }, uid()));
  },
  regenerate: (m) => startTurn(store.current, store.current.nodes[m.parent]),
  resume: (m) => startTurn(store.current, store.current.nodes[m.parent], m),
  remove: (m) => {
    remove(store.current, m);
    store.touch(store.current);
    renderMessages();
  },
  shift: (m, delta) => {
    shift(store.current, m, delta);
    store.save();
    renderMessages();
  },
  redraw: () => renderMessages(),
});

const settings = new SettingsPanel($("settings"), config.defaults, {
  onChange: () => store.save(),
  onSaveDefaults: (values) => {
    store.newChatSettings = values;
    store.save();
  },
});

// -- conversations ------------------------------------------------------------------

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  const shown = store.search($("search").value);
  for (const c of shown) {
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
    const del = button("✕", "link delete", "Delete conversation", (e) => {
      e.stopPropagation();
      if (confirm(`Delete “${c.title}”?`)) deleteConversation(c.id);
    });
    li.append(name, rename, del);
    li.addEventListener("click", () => {
      store.select(c.id);
      closeSidebar();
      renderAll();
    });
    list.append(li);
  }
  if (!shown.length) {
    const li = document.createElement("li");
    li.className = "none";
    li.textContent = "No conversation matches.";
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
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
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

function exportConversations() {
  const blob = new Blob([store.exportJSON()], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `parley-conversations-${new Date().toISOString().slice(0, 10)}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importConversations(file) {
  const note = $("sidebar-note");
  try {
    const n = store.importJSON(await file.text());
    note.textContent = `Imported ${n} conversation${n === 1 ? "" : "s"}.`;
    note.className = "note";
    renderAll();
  } catch (err) {
    note.textContent = `Import failed: ${err.message}.`;
    note.className = "note error";
  }
}

// -- messages -----------------------------------------------------------------------

function renderMessages() {
  const conversation = store.current;
  thread.render(conversation, path(conversation), inflight.get(conversation.id)?.message, config.context_window);
  settings.show(conversation);
  updateGauge();
  updateComposer();
}

// The latest turn's context use: its prompt and its reply so far.
function updateGauge() {
  const gauge = $("gauge");
  const last = [...path(store.current)].reverse().find((m) => m.role === "assistant" && m.prompt_tokens != null);
  const used = last ? last.prompt_tokens + (last.stats?.completion_tokens ?? last.liveTokens ?? 0) : 0;
  const window = config.context_window;
  const meter = gauge.querySelector("meter");
  Object.assign(meter, { max: window, low: 0.7 * window, high: 0.9 * window, optimum: 0 });
  meter.value = Math.min(used, window);
  gauge.querySelector(".label").textContent = `${used.toLocaleString("en")} / ${window.toLocaleString("en")}`;
  gauge.title = `Context used by the latest turn: ${used} of the model's ${window} tokens. When it is full, the oldest turns are dropped.`;
}

// Update the streaming reply at most once per frame while tokens come in.
function scheduleLive(conversation, reply) {
  if (liveQueued || conversation.id !== store.currentId) return;
  liveQueued = true;
  requestAnimationFrame(() => {
    liveQueued = false;
    if (inflight.get(store.currentId)?.message !== reply) return;
    thread.update(reply, config.context_window);
    updateGauge();
  });
}

// -- turns --------------------------------------------------------------------------

function send(text) {
  const conversation = store.current;
  if (inflight.has(conversation.id)) return;
  const last = path(conversation).at(-1);
  const user = append(conversation, last?.id ?? ROOT, { role: "user", content: text }, uid());
  store.touch(conversation);
  thread.following = true;
  startTurn(conversation, user);
}

// A turn answering the path up to `parent` (a user message): a new reply under it, or,
// with `resumed`, the rest of that reply (cut at its length limit).
function startTurn(conversation, parent, resumed = null) {
  if (inflight.has(conversation.id)) return;
  const nodes = pathTo(conversation, resumed ?? parent).filter(
    (m) => m.content && (m.role === "user" || m.role === "assistant"),
  );
  const messages = nodes.map((m) => ({ role: m.role, content: m.content }));
  // A reply in flight keeps its turn id and the last seq shown, saved with its text: after
  // a reconnect or a reload, the page asks the server for the rest (see attach()).
  const reply = resumed ?? append(conversation, parent.id, { role: "assistant", content: "" }, uid());
  Object.assign(reply, { partial: true, lastSeq: -1, turnId: uid(), liveTokens: 0, liveRate: null });
  for (const key of ["error", "stats", "finish", "stopped", "seenFrom"]) delete reply[key];
  reply.seen = nodes.map((m) => m.id); // to mark what the model no longer sees
  const { params, system } = turnSettings(conversation.settings ?? {});
  const frame = { type: "chat", id: reply.turnId, conversation_id: conversation.id, messages, params };
  if (system) frame.system = system;
  if (resumed) frame.continue = true;
  const turn = { turnId: reply.turnId, message: reply };
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
    const dropped = frame.dropped_messages ?? 0;
    if (dropped && reply.seen?.[dropped]) reply.seenFrom = reply.seen[dropped];
    else delete reply.seenFrom;
    if (conversation.id === store.currentId) renderMessages();
    return;
  }
  if (frame.type === "token") {
    if (frame.seq <= reply.lastSeq) return; // sent again after a resume: shown already
    reply.lastSeq = frame.seq;
    reply.content += frame.text;
    reply.liveTokens = frame.completion_tokens ?? (reply.liveTokens ?? 0) + 1;
    const now = performance.now();
    if (turn.firstAt === undefined) {
      turn.firstAt = now;
      turn.firstTokens = reply.liveTokens;
    } else if (now - turn.firstAt > 250) {
      reply.liveRate = ((reply.liveTokens - turn.firstTokens) * 1000) / (now - turn.firstAt);
    }
    saveSoon();
    scheduleLive(conversation, reply);
    return;
  }
  if (frame.type !== "done" && frame.type !== "error") return;
  for (const key of ["partial", "turnId", "lastSeq", "liveRate", "seen"]) delete reply[key];
  if (frame.type === "done") {
    reply.stats = {
      ...frame.timings,
      prompt_tokens: frame.usage.prompt_tokens,
      cached_tokens: frame.usage.cached_tokens,
      completion_tokens: frame.usage.completion_tokens,
    };
    reply.finish = frame.finish_reason;
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

function openSidebar() {
  $("sidebar").classList.add("open");
  $("backdrop").hidden = false;
}

function closeSidebar() {
  $("sidebar").classList.remove("open");
  $("backdrop").hidden = true;
}

function applyTheme() {
  document.documentElement.dataset.theme = store.theme;
}

function renderAll() {
  renderSidebar();
  renderMessages();
}

function init() {
  // A reply cut short by a reload is asked for again (the server keeps a turn for a while
  // after its socket drops); one that cannot be stays, marked as interrupted.
  for (const c of store.conversations) {
    const last = path(c).at(-1);
    for (const m of Object.values(c.nodes)) {
      if (!m.partial) continue;
      if (m.turnId && m === last) {
        attach(c, m);
      } else {
        for (const key of ["partial", "turnId", "lastSeq"]) delete m[key];
        m.error = "interrupted";
      }
    }
  }
  applyTheme();
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
    store.openEmpty();
    closeSidebar();
    renderAll();
    input.focus();
  });
  $("search").addEventListener("input", renderSidebar);
  $("export").addEventListener("click", exportConversations);
  $("import").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", (e) => {
    const [file] = e.target.files;
    if (file) importConversations(file);
    e.target.value = "";
  });
  $("toggle-theme").addEventListener("click", () => {
    store.theme = store.theme === "dark" ? "light" : "dark";
    store.save();
    applyTheme();
  });
  $("toggle-settings").addEventListener("click", () => {
    $("settings").hidden = !$("settings").hidden;
  });
  $("toggle-sidebar").addEventListener("click", () => ($("sidebar").classList.contains("open") ? closeSidebar() : openSidebar()));
  $("backdrop").addEventListener("click", closeSidebar);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") closeSidebar();
  });
  renderAll();
  input.focus();
  connection.start();
}

init();
