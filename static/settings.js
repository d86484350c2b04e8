// The settings of one conversation: its system prompt and every sampling parameter /ws
// takes. A field left empty is not sent, and its placeholder shows the server's default
// (told by the page, app/server/page.py); "Use for new chats" keeps them for the next.

import { BUILTIN_SETTINGS } from "./store.js";

// key, label, input type, and for numbers their bounds and step.
export const FIELDS = [
  ["temperature", "Temperature", "number", 0, 2, 0.05],
  ["top_p", "Top p", "number", 0.01, 1, 0.01],
  ["top_k", "Top k", "number", 0, 100000, 1],
  ["min_p", "Min p", "number", 0, 1, 0.01],
  ["max_tokens", "Max tokens", "number", 1, 1000000, 1],
  ["seed", "Seed", "number", 0, Number.MAX_SAFE_INTEGER, 1],
  ["presence_penalty", "Presence penalty", "number", -2, 2, 0.1],
  ["frequency_penalty", "Frequency penalty", "number", -2, 2, 0.1],
  ["repetition_penalty", "Repetition penalty", "number", 0.01, 10, 0.05],
  ["stop", "Stop strings (one a line)", "lines"],
  ["ignore_eos", "Ignore end of text", "checkbox"],
];

// What a default of null means, where "none" would not say it.
const UNSET = { max_tokens: "up to the window", seed: "random" };

function describe(value, key) {
  if (value === null || value === undefined) return UNSET[key] ?? "none";
  if (Array.isArray(value)) return value.length ? value.join(", ") : "none";
  if (typeof value === "boolean") return value ? "on" : "off";
  return String(value);
}

export class SettingsPanel {
  constructor(root, defaults, { onChange, onSaveDefaults }) {
    this.root = root;
    this.defaults = defaults; // the server's, by key
    this.onChange = onChange;
    this.onSaveDefaults = onSaveDefaults;
    this.inputs = new Map();
    this.conversation = null;
    this.build();
  }

  build() {
    const grid = this.root.querySelector(".fields");
    for (const [key, label, type, min, max, step] of FIELDS) {
      const wrap = document.createElement("label");
      wrap.className = `field ${type}`;
      const name = document.createElement("span");
      name.textContent = label;
      let input;
      if (type === "lines") {
        input = document.createElement("textarea");
        input.rows = 1;
      } else {
        input = document.createElement("input");
        input.type = type;
        if (type === "number") Object.assign(input, { min, max, step });
      }
      input.id = `setting-${key.replace(/_/g, "-")}`;
      input.dataset.key = key;
      const hint = document.createElement("small");
      hint.className = "default";
      hint.textContent = `default: ${describe(this.defaults[key], key)}`;
      if (type !== "checkbox") input.placeholder = describe(this.defaults[key], key);
      input.addEventListener("change", () => this.read(key, type, input));
      if (type === "checkbox") wrap.append(input, name, hint);
      else wrap.append(name, input, hint);
      grid.append(wrap);
      this.inputs.set(key, input);
    }
    const system = this.root.querySelector("#system-prompt");
    system.addEventListener("change", () => this.set("system", system.value));
    this.inputs.set("system", system);
    this.root.querySelector("#settings-reset").addEventListener("click", () => {
      if (!this.conversation) return;
      this.conversation.settings = { ...BUILTIN_SETTINGS };
      this.show(this.conversation);
      this.onChange();
    });
    this.root.querySelector("#settings-save-defaults").addEventListener("click", (e) => {
      if (!this.conversation) return;
      this.onSaveDefaults({ ...this.conversation.settings });
      e.target.textContent = "Saved for new chats";
      setTimeout(() => {
        e.target.textContent = "Use for new chats";
      }, 1500);
    });
  }

  read(key, type, input) {
    if (type === "checkbox") this.set(key, input.checked || undefined);
    else if (type === "lines") {
      const lines = input.value.split("\n").filter((s) => s.length);
      this.set(key, lines.length ? lines : undefined);
    } else this.set(key, input.value === "" ? undefined : Number(input.value));
  }

  set(key, value) {
    if (!this.conversation) return;
    if (value === undefined || value === "") delete this.conversation.settings[key];
    else this.conversation.settings[key] = value;
    this.onChange();
  }

  // Show the settings of `conversation`.
  show(conversation) {
    this.conversation = conversation;
    const s = conversation.settings ?? (conversation.settings = { ...BUILTIN_SETTINGS });
    for (const [key, input] of this.inputs) {
      const value = s[key];
      if (input.type === "checkbox") input.checked = Boolean(value);
      else if (Array.isArray(value)) input.value = value.join("\n");
      else input.value = value ?? "";
    }
  }
}

// The `params` and `system` of a chat frame from a conversation's settings.
export function turnSettings(settings) {
  const params = {};
  for (const [key, , type] of FIELDS) {
    const value = settings[key];
    if (value === undefined || value === null || value === "") continue;
    if (type === "number" && !Number.isFinite(Number(value))) continue;
    params[key] = type === "number" ? Number(value) : value;
  }
  for (const key of ["top_k", "max_tokens", "seed"]) {
    if (key in params) params[key] = Math.round(params[key]);
  }
  return { params, system: (settings.system ?? "").trim() || null };
}
