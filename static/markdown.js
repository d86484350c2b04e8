// Model replies as rendered Markdown. The server renders (POST /render: markdown-it-py
// and Pygments, app/server/markdown.py), which escapes any HTML in model text, so its
// answer is set as it comes. Texts asked for in the same tick go in one request; a reply
// that streams shows its last rendered text plus the raw tail, and asks again once the
// answer is in (one request in flight per reply, so a fast stream never queues them, and
// never sooner than four times the last request took).

const CACHE_LIMIT = 400;
const MIN_INTERVAL_MS = 100;

export class Markdown {
  constructor(url = "/render") {
    this.url = url;
    this.cache = new Map(); // text -> html, most recently used last
    this.queue = new Map(); // text -> [bubble] waiting for it
    this.flushing = false;
  }

  // Show `text` in `bubble` rendered: at once from the cache, else what it showed last
  // (with the new tail as text) until the HTML comes back.
  show(bubble, text) {
    bubble.wanted = text;
    const html = this.cached(text);
    if (html !== undefined) {
      this.fill(bubble, text, html);
      return;
    }
    if (bubble.shown !== undefined && text.startsWith(bubble.shown.text)) {
      this.fill(bubble, bubble.shown.text, bubble.shown.html, text.slice(bubble.shown.text.length));
    } else if (bubble.shown === undefined || bubble.shown.text !== text) {
      bubble.replaceChildren(paragraph(text));
      bubble.shown = undefined;
      bubble.classList.remove("rendered");
    }
    if (bubble.pending) return; // asks again for bubble.wanted when the answer is in
    bubble.pending = true;
    if (!this.queue.has(text)) this.queue.set(text, []);
    this.queue.get(text).push(bubble);
    if (!this.flushing) {
      this.flushing = true;
      queueMicrotask(() => this.flush());
    }
  }

  cached(text) {
    const html = this.cache.get(text);
    if (html !== undefined) {
      this.cache.delete(text);
      this.cache.set(text, html);
    }
    return html;
  }

  async flush() {
    const batch = this.queue;
    this.queue = new Map();
    this.flushing = false;
    const texts = [...batch.keys()];
    let html = null;
    const started = performance.now();
    try {
      const response = await fetch(this.url, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ texts }),
      });
      if (response.ok) html = (await response.json()).html;
    } catch {
      html = null;
    }
    // A streaming reply asks again after at least four times what this took: rendering
    // runs on the cores the model runs on, so a long reply costs it at most ~1/5 of one.
    const again = html ? Math.max(MIN_INTERVAL_MS, 4 * (performance.now() - started)) : 1000;
    texts.forEach((text, i) => {
      if (html) {
        this.cache.set(text, html[i]);
        if (this.cache.size > CACHE_LIMIT) this.cache.delete(this.cache.keys().next().value);
      }
      for (const bubble of batch.get(text)) {
        bubble.pending = false;
        if (html && bubble.wanted.startsWith(text)) this.fill(bubble, text, html[i], bubble.wanted.slice(text.length));
        if ((bubble.wanted !== text || !html) && bubble.isConnected) {
          setTimeout(() => this.show(bubble, bubble.wanted), again);
        }
      }
    });
  }

  // The bubble shows `html` (the rendering of `text`), then `tail` as plain text.
  fill(bubble, text, html, tail = "") {
    if (bubble.shown?.text !== text) {
      const template = document.createElement("template");
      template.innerHTML = html; // the server's rendering: model text is escaped there
      decorate(template.content);
      bubble.replaceChildren(template.content);
      bubble.shown = { text, html };
    }
    let live = bubble.querySelector(":scope > .tail");
    if (tail) {
      if (!live) {
        live = document.createElement("span");
        live.className = "tail";
        bubble.append(live);
      }
      live.textContent = tail;
    } else if (live) {
      live.remove();
    }
    bubble.classList.toggle("rendered", !tail); // all of the text is rendered
  }
}

function paragraph(text) {
  const p = document.createElement("p");
  p.className = "raw";
  p.textContent = text;
  return p;
}

// Code blocks get their language and a copy button; ordered lists room for their longest
// number (a list at 100 needs more than one at 1).
function decorate(root) {
  for (const pre of root.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    const language = (code?.className.match(/language-([\w+#.-]+)/) ?? [])[1];
    const head = document.createElement("div");
    head.className = "code-head";
    const label = document.createElement("span");
    label.textContent = language || "code";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "link copy";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyText(code?.textContent ?? "", copy));
    head.append(label, copy);
    pre.prepend(head);
  }
  for (const ol of root.querySelectorAll("ol")) {
    const last = Number(ol.getAttribute("start") || 1) + ol.children.length - 1;
    ol.classList.add(`digits-${Math.min(String(Math.max(1, last)).length, 6)}`);
  }
}

export async function copyText(text, button) {
  const label = button.textContent;
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => {
    button.textContent = label;
  }, 1500);
}
