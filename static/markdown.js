// Markdown for model replies, built as DOM nodes: model text only ever becomes
// textContent, never HTML, so a reply cannot inject markup or script into the page.
//
// Covers what chat replies use: paragraphs, headings, fenced code (with a copy button),
// lists, block quotes, inline code, bold, italics and http(s) links. An unclosed code
// fence (a reply still streaming) renders as code so far.

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = text.replace(/\r\n/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
      i += 1; // the closing fence, if any
      root.append(codeBlock(body.join("\n"), fence[1]));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const h = document.createElement(`h${Math.min(heading[1].length, 3)}`);
      inline(h, heading[2]);
      root.append(h);
      i += 1;
      continue;
    }
    if (/^\s*([-*+]|\d+[.)])\s+/.test(line)) {
      const ordered = /^\s*\d+[.)]\s+/.test(line);
      const list = document.createElement(ordered ? "ol" : "ul");
      while (i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i])) {
        const li = document.createElement("li");
        inline(li, lines[i].replace(/^\s*([-*+]|\d+[.)])\s+/, ""));
        list.append(li);
        i += 1;
      }
      root.append(list);
      continue;
    }
    if (/^\s*>/.test(line)) {
      const quote = document.createElement("blockquote");
      const body = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) body.push(lines[i++].replace(/^\s*>\s?/, ""));
      inline(quote, body.join("\n"));
      root.append(quote);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) para.push(lines[i++]);
    const p = document.createElement("p");
    inline(p, para.join("\n"));
    root.append(p);
  }
  return root;
}

function startsBlock(line) {
  return /^\s*```/.test(line) || /^#{1,6}\s/.test(line) || /^\s*([-*+]|\d+[.)])\s+/.test(line) || /^\s*>/.test(line);
}

function codeBlock(code, language) {
  const pre = document.createElement("pre");
  const head = document.createElement("div");
  head.className = "code-head";
  const label = document.createElement("span");
  label.textContent = language || "code";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "link copy";
  copy.textContent = "Copy";
  copy.addEventListener("click", () => copyText(code, copy));
  head.append(label, copy);
  const el = document.createElement("code");
  el.textContent = code;
  pre.append(head, el);
  return pre;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// Inline spans: `code`, **bold**, *italic* / _italic_, [text](http://...). Text between
// them becomes text nodes; unmatched markers stay as they are.
const INLINE = /`([^`\n]+)`|\*\*([^*\n]+)\*\*|\*([^*\n]+)\*|_([^_\n]+)_|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    if (m[1] !== undefined) parent.append(element("code", m[1]));
    else if (m[2] !== undefined) parent.append(element("strong", m[2]));
    else if (m[3] !== undefined || m[4] !== undefined) parent.append(element("em", m[3] ?? m[4]));
    else parent.append(link(m[5], m[6]));
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
}

function element(tag, text) {
  const el = document.createElement(tag);
  el.textContent = text;
  return el;
}

function link(text, href) {
  let url;
  try {
    url = new URL(href);
  } catch {
    return document.createTextNode(`[${text}](${href})`);
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    return document.createTextNode(text); // javascript:, data: ... never become links
  }
  const a = element("a", text);
  a.href = url.href;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  return a;
}
