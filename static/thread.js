// The message list of one conversation. It is built once when the conversation (or its
// shape) changes; while a reply streams only that reply's bubble and numbers change, so a
// selection or a scroll position elsewhere stays put. The list follows the bottom only
// while the reader is there; otherwise a "jump to latest" button appears.

import { copyText } from "./markdown.js";
import { siblings } from "./tree.js";

const NEAR_BOTTOM_PX = 32;

export class Thread {
  constructor(box, jump, markdown, actions) {
    this.box = box;
    this.jump = jump;
    this.markdown = markdown;
    this.actions = actions; // { edit, regenerate, resume, remove, shift, idle() -> bool }
    this.views = new Map(); // node id -> { el, bubble, stats }
    this.following = true;
    box.addEventListener("scroll", () => {
      this.following = this.atBottom();
      if (this.following) this.jump.hidden = true;
    });
    jump.addEventListener("click", () => this.toBottom());
  }

  atBottom() {
    const b = this.box;
    return b.scrollHeight - b.scrollTop - b.clientHeight < NEAR_BOTTOM_PX;
  }

  toBottom() {
    this.following = true;
    this.jump.hidden = true;
    this.box.scrollTop = this.box.scrollHeight;
  }

  // Build the list for `messages` (the path shown); `live` is the reply streaming, if any.
  render(conversation, messages, live, context) {
    if (conversation !== this.conversation) this.following = true; // another chat: its end
    this.conversation = conversation;
    this.context = context;
    const keep = this.following;
    this.views.clear();
    this.box.replaceChildren();
    if (!messages.length) {
      const empty = document.createElement("div");
      empty.className = "empty";
      empty.textContent = "Ask anything. Replies stream as they are written.";
      this.box.append(empty);
    }
    const last = messages.at(-1);
    const seenFrom = [...messages].reverse().find((m) => m.role === "assistant" && m.seenFrom)?.seenFrom;
    messages.forEach((m, i) => {
      if (seenFrom && m.id === seenFrom) this.box.append(divider());
      this.box.append(this.element(m, m === live, m === last, i));
    });
    if (keep) this.toBottom();
  }

  element(m, live, last) {
    const el = document.createElement("div");
    el.className = `message ${m.role}`;
    el.dataset.id = m.id;
    if (live) el.classList.add("streaming");
    const bubble = document.createElement("div");
    bubble.className = "bubble";
    if (m.role === "assistant") this.markdown.show(bubble, m.content);
    else bubble.textContent = m.content;
    const meta = document.createElement("div");
    meta.className = "meta";
    const { index, count } = siblings(this.conversation, m);
    if (count > 1) meta.append(this.branches(m, index, count));
    const stats = document.createElement("span");
    stats.className = "stats";
    stats.textContent = statsText(m, live, this.context);
    meta.append(stats);
    if (m.error) meta.append(span("error", m.error));
    const idle = this.actions.idle();
    meta.append(button("Copy", "link copy-message", "Copy the whole message", (e) => copyText(m.content, e.target)));
    if (idle && m.role === "user") {
      meta.append(button("✎ Edit", "link edit", "Edit (the earlier version is kept)", () => this.startEdit(el, m)));
    }
    if (idle && m.role === "assistant") {
      if (last && m.finish === "length") {
        meta.append(button("→ Continue", "link continue", "Continue this reply", () => this.actions.resume(m)));
      }
      meta.append(button("↻ Regenerate", "link regenerate", "Regenerate (the earlier reply is kept)", () => this.actions.regenerate(m)));
    }
    if (idle) meta.append(button("Delete", "link delete-message", "Delete this message", () => this.actions.remove(m)));
    el.append(bubble, meta);
    this.views.set(m.id, { el, bubble, stats });
    return el;
  }

  branches(m, index, count) {
    const nav = document.createElement("span");
    nav.className = "branches";
    const idle = this.actions.idle();
    const prev = button("‹", "link prev", "Previous version", () => this.actions.shift(m, -1));
    const next = button("›", "link next", "Next version", () => this.actions.shift(m, +1));
    prev.disabled = !idle || index === 0;
    next.disabled = !idle || index === count - 1;
    nav.append(prev, span("position", `${index + 1}/${count}`), next);
    return nav;
  }

  // The streaming reply changed: its text and numbers, nothing else.
  update(m, context) {
    const view = this.views.get(m.id);
    if (!view) return;
    this.markdown.show(view.bubble, m.content);
    view.stats.textContent = statsText(m, true, context);
    if (this.following) this.box.scrollTop = this.box.scrollHeight;
    else this.jump.hidden = false;
  }

  startEdit(el, m) {
    const area = document.createElement("textarea");
    area.className = "edit";
    area.value = m.content;
    const save = button("Save & send", "primary save", "Send the edited message as a new version", () => {
      const text = area.value.trim();
      if (text) this.actions.edit(m, text);
    });
    const cancel = button("Cancel", "", "Cancel editing", () => this.actions.redraw());
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.append(save, cancel);
    el.replaceChildren(area, meta);
    area.focus();
  }
}

function statsText(m, live, context) {
  const s = m.stats;
  if (live) {
    const parts = [];
    const tokens = m.liveTokens ?? 0;
    parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
    if (m.liveRate != null) parts.push(`${m.liveRate.toFixed(1)} tok/s`);
    if (m.prompt_tokens != null && context) parts.push(`context ${m.prompt_tokens + tokens} of ${context}`);
    return parts.join(" · ");
  }
  if (!s) return m.stopped ? "stopped" : "";
  const parts = [];
  if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  if (s.tokens_per_s != null) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
  if (s.completion_tokens != null) parts.push(`${s.completion_tokens} tokens`);
  if (s.prompt_tokens != null) parts.push(`reused ${s.cached_tokens} of ${s.prompt_tokens} prompt tokens`);
  if (m.stopped) parts.push("stopped");
  if (m.finish === "length") parts.push("cut at the length limit");
  return parts.join(" · ");
}

function divider() {
  const d = document.createElement("div");
  d.className = "dropped";
  d.setAttribute("role", "note");
  d.textContent = "Earlier messages are no longer seen by the model (the context window is full).";
  return d;
}

function span(className, text) {
  const s = document.createElement("span");
  s.className = className;
  s.textContent = text;
  return s;
}

export function button(label, className, title, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = label;
  b.title = title;
  b.setAttribute("aria-label", title);
  b.addEventListener("click", onClick);
  return b;
}
