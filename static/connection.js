// The /ws connection: reconnects with backoff, reports its state, routes frames by turn id.

const MIN_DELAY_MS = 500;
const MAX_DELAY_MS = 8000;

export class Connection {
  constructor(url, { onState, onFrame }) {
    this.url = url;
    this.onState = onState; // ("connecting" | "open" | "reconnecting" | "closed", detail)
    this.onFrame = onFrame; // (frame) for frames that belong to no live turn handler
    this.handlers = new Map(); // turn id -> callback(frame)
    this.delay = MIN_DELAY_MS;
    this.socket = null;
  }

  start() {
    this.connect("connecting");
    window.addEventListener("online", () => this.retryNow());
  }

  connect(state) {
    this.onState(state);
    const socket = new WebSocket(this.url);
    this.socket = socket;
    socket.addEventListener("open", () => {
      this.delay = MIN_DELAY_MS;
      this.onState("open");
    });
    socket.addEventListener("message", (event) => {
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch {
        return;
      }
      const handler = frame.id != null ? this.handlers.get(frame.id) : undefined;
      if (handler) handler(frame);
      else this.onFrame(frame);
      if (handler && (frame.type === "done" || frame.type === "error")) this.handlers.delete(frame.id);
    });
    socket.addEventListener("close", () => {
      if (this.socket !== socket) return;
      // Turns in flight on this socket are gone (the server cancelled them).
      for (const [id, handler] of this.handlers) {
        handler({ type: "error", id, code: "disconnected", message: "connection lost", retryable: true });
      }
      this.handlers.clear();
      const wait = this.delay;
      this.delay = Math.min(this.delay * 2, MAX_DELAY_MS);
      this.onState("reconnecting", wait);
      this.timer = setTimeout(() => this.connect("reconnecting"), wait);
    });
  }

  retryNow() {
    if (this.socket && this.socket.readyState === WebSocket.OPEN) return;
    clearTimeout(this.timer);
    this.delay = MIN_DELAY_MS;
    this.connect("reconnecting");
  }

  get isOpen() {
    return this.socket !== null && this.socket.readyState === WebSocket.OPEN;
  }

  send(frame, handler) {
    if (!this.isOpen) return false;
    if (handler) this.handlers.set(frame.id, handler);
    this.socket.send(JSON.stringify(frame));
    return true;
  }
}
