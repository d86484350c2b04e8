"""DNS rebinding in a real browser. Chromium resolves evil.example to 127.0.0.1. The
attacker's page is loaded from evil.example:PORT; then the attacker's server leaves the
port and Parley takes it, as a rebound name would send the page's next requests to the
user's Parley. To the browser those requests are same-origin: only the Host tells."""

import http.server
import threading

from app.server.app import create_app
from tests.e2e.live_server import CHROMIUM, CHROMIUM_ARGS, chromium_or_skip, live_server
from tests.redis_server import free_port
from tests.server.fake_engine import FakeEngine

ATTACK = """<!doctype html><title>attacker</title><script>
window.attack = async () => {
  const body = JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 3});
  const r = await fetch("/v1/chat/completions",
                        {method: "POST", body, headers: {"Content-Type": "text/plain"}});
  const socket = await new Promise((done) => {
    const ws = new WebSocket(`ws://${location.host}/ws`);
    ws.onopen = () => done("open");
    ws.onerror = () => done("refused");
  });
  return {status: r.status, text: await r.text(), socket};
};
</script>"""


def attacker(port: int) -> http.server.HTTPServer:
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = ATTACK.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_rebound_page_cannot_chat_through_the_local_server(tokenizer):
    sync_api = chromium_or_skip()
    rules = "--host-resolver-rules=MAP evil.example 127.0.0.1"
    port = free_port()
    fake = FakeEngine(tokenizer, reply="the attacker reads this")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, rules])
        try:
            page = browser.new_page()
            evil = attacker(port)
            page.goto(f"http://evil.example:{port}/")
            evil.shutdown()
            evil.server_close()
            with live_server(create_app(engine=fake), port=port):
                result = page.evaluate("() => window.attack()")
                # The same browser at the loopback name is served (the refusal is the Host).
                page.goto(f"http://127.0.0.1:{port}/health")
                assert page.evaluate("() => fetch('/health').then((r) => r.status)") == 200
        finally:
            browser.close()
    assert result["status"] == 400 and "host_not_allowed" in result["text"]
    assert "attacker reads" not in result["text"]
    assert result["socket"] == "refused"
    assert not fake.prompts  # the engine never heard of it
