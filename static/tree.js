// A conversation's messages as a tree: editing a message or regenerating a reply adds a
// sibling instead of replacing it, so earlier versions stay (‹ 2/3 ›). The thread shown is
// one path from the root, following each node's active child.
//
// conversation.nodes: { id: { id, role, content, parent, children: [ids], active, ... } },
// with a root node "root" (no role) whose children are the first messages' versions.

export const ROOT = "root";

export function emptyTree() {
  return { [ROOT]: { id: ROOT, parent: null, children: [], active: 0 } };
}

// The messages shown: from the root down the active children.
export function path(conversation) {
  const out = [];
  let node = conversation.nodes[ROOT];
  while (node.children.length) {
    node = conversation.nodes[node.children[Math.min(node.active, node.children.length - 1)]];
    out.push(node);
  }
  return out;
}

// The path up to and including `node`.
export function pathTo(conversation, node) {
  const out = [];
  for (let n = node; n && n.id !== ROOT; n = conversation.nodes[n.parent]) out.unshift(n);
  return out;
}

// Add `message` as the newest (and active) child of `parentId`.
export function append(conversation, parentId, message, id) {
  const parent = conversation.nodes[parentId];
  const node = { ...message, id, parent: parentId, children: [], active: 0 };
  conversation.nodes[id] = node;
  parent.children.push(id);
  parent.active = parent.children.length - 1;
  return node;
}

// Where `node` stands among its parent's children: { index, count }.
export function siblings(conversation, node) {
  const parent = conversation.nodes[node.parent];
  return { index: parent.children.indexOf(node.id), count: parent.children.length };
}

// Show the sibling `delta` away from `node` (‹ or ›).
export function shift(conversation, node, delta) {
  const parent = conversation.nodes[node.parent];
  const next = parent.children.indexOf(node.id) + delta;
  if (next >= 0 && next < parent.children.length) parent.active = next;
}

// Take one message out: its children take its place under its parent.
export function remove(conversation, node) {
  const parent = conversation.nodes[node.parent];
  const at = parent.children.indexOf(node.id);
  parent.children.splice(at, 1, ...node.children);
  for (const child of node.children) conversation.nodes[child].parent = parent.id;
  if (parent.active >= at) {
    // The path shown goes on through the removed node's active child, if it had one.
    parent.active = node.children.length ? at + Math.min(node.active, node.children.length - 1) : Math.max(0, at - 1);
  }
  delete conversation.nodes[node.id];
}

// The tree of a list of { role, content } messages (the v1 format, and imports).
export function fromMessages(messages, newId) {
  const conversation = { nodes: emptyTree() };
  let parent = ROOT;
  for (const m of messages) parent = append(conversation, parent, m, newId()).id;
  return conversation.nodes;
}
