// The /ws connection: reconnects with backoff, reports its state, routes frames by turn id,
// and re-attaches the turns in flight after a reconnect (a `resume` frame each: the server
// keeps a turn running for a grace period after its socket drops, and replays what this
// page missed).

const MIN_DELAY_MS = 500;
const MAX_DELAY_MS = 8000;

export class Connection {
  constructor(url, { onState, onFrame }) {
    this.url = url;
    this.onState = onState; // ("connecting" | "open" | "reconnecting" | "closed", detail)
    this.onFrame = onFrame; // (frame) for frames that belong to no live turn handler
    this.handlers = new Map(); // turn id -> { onFrame(frame), resume() -> resume frame | null }
    this.delay = MIN_DELAY_MS;
    this.socket = null;
  }

  start() {
    this.connect("connecting");
    window.addEventListener("online", () => this.retryNow());
    // Off the network, an open socket can take minutes to notice, and its closing
    // handshake needs the network that just went away: count it lost now, and re-attach
    // the turns in flight once the network is back.
    window.addEventListener("offline", () => {
      const socket = this.socket;
      if (!socket || socket.readyState > WebSocket.OPEN) return;
      socket.close();
      this.lost(socket);
    });
  }

  connect(state) {
    this.onState(state);
    const socket = new WebSocket(this.url);
    this.socket = socket;
    socket.addEventListener("open", () => {
      this.delay = MIN_DELAY_MS;
      this.onState("open");
      for (const [id, handler] of this.handlers) {
        const frame = handler.resume?.();
        if (frame) socket.send(JSON.stringify(frame));
        else this.fail(id, handler);
      }
    });
    socket.addEventListener("message", (event) => {
      if (socket.lost) return; // a resume on the next socket replays what comes after
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch {
        return;
      }
      const handler = frame.id != null ? this.handlers.get(frame.id) : undefined;
      if (handler) handler.onFrame(frame);
      else this.onFrame(frame);
      if (handler && (frame.type === "done" || frame.type === "error")) this.handlers.delete(frame.id);
    });
    socket.addEventListener("close", () => this.lost(socket));
  }

  // The socket is gone (closed, or let go when the network went away): once per socket.
  lost(socket) {
    if (this.socket !== socket || socket.lost) return;
    socket.lost = true;
    // Turns that cannot resume are gone; the others wait for the next socket.
    for (const [id, handler] of this.handlers) {
      if (!handler.resume) this.fail(id, handler);
    }
    const wait = this.delay;
    this.delay = Math.min(this.delay * 2, MAX_DELAY_MS);
    this.onState("reconnecting", wait);
    this.timer = setTimeout(() => this.connect("reconnecting"), wait);
  }

  fail(id, handler) {
    this.handlers.delete(id);
    handler.onFrame({ type: "error", id, code: "disconnected", message: "connection lost", retryable: true });
  }

  retryNow() {
    if (this.socket && !this.socket.lost && this.socket.readyState <= WebSocket.OPEN) return; // connecting or open
    clearTimeout(this.timer);
    this.delay = MIN_DELAY_MS;
    this.connect("reconnecting");
  }

  get isOpen() {
    return this.socket !== null && !this.socket.lost && this.socket.readyState === WebSocket.OPEN;
  }

  // Route the frames of a turn already in flight (a reply that was streaming before a
  // reload) to `onFrame`; it is re-attached with `resume()` once the socket is open.
  expect(id, onFrame, resume) {
    this.handlers.set(id, { onFrame, resume });
    if (this.isOpen) this.socket.send(JSON.stringify(resume()));
  }

  // Send a frame. With `onFrame`, the turn's frames go to it; with `resume` (a function
  // returning the resume frame to send), the turn is re-attached after a reconnect.
  send(frame, onFrame, resume) {
    if (!this.isOpen) return false;
    if (onFrame) this.handlers.set(frame.id, { onFrame, resume });
    this.socket.send(JSON.stringify(frame));
    return true;
  }
}
