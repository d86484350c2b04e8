"""Access control in a real browser: another site's page cannot open Parley's WebSocket;
with an API key, the page asks for it once and then works, and a client without it is
refused."""

import http.server
import threading

from app.server.app import ServerConfig, create_app
from tests.e2e.live_server import live_server
from tests.e2e.page_util import wait_reply_done
from tests.server.fake_engine import FakeEngine

PROBE = """<!doctype html><title>probe</title><script>
const ws = new WebSocket("%s");
ws.onopen = () => { document.title = "open"; };
ws.onerror = () => { document.title = "refused"; };
</script>"""


def serve_html(html: str):
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_another_origin_cannot_open_the_websocket(browser, tokenizer):
    with live_server(create_app(engine=FakeEngine(tokenizer))) as parley:
        ws = parley.url.replace("http", "ws") + "/ws"
        evil = serve_html(PROBE % ws)
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{evil.server_address[1]}/")
            page.wait_for_function("() => document.title !== 'probe'", timeout=10_000)
            assert page.title() == "refused"
            # The same probe from Parley's own origin opens (so the refusal is the Origin).
            page.goto(parley.url + "/health")
            page.evaluate(f"() => {{ const w = new WebSocket('{ws}');"
                          "w.onopen = () => { document.title = 'open'; }; }")  # fmt: skip
            page.wait_for_function("() => document.title === 'open'", timeout=10_000)
            page.close()
        finally:
            evil.shutdown()


def test_with_a_key_the_page_asks_once_and_works(browser, tokenizer):
    fake = FakeEngine(tokenizer, reply="keyed reply")
    app = create_app(engine=fake, server_config=ServerConfig(api_key="k3y"))
    with live_server(app) as parley:
        context = browser.new_context()
        page = context.new_page()
        page.goto(parley.url)
        assert page.is_visible("form.login")
        page.fill("input[name=key]", "wrong")
        page.click("button[type=submit]")
        assert page.is_visible("form.login .error")
        page.fill("input[name=key]", "k3y")
        page.click("button[type=submit]")
        page.wait_for_selector("#connection[data-state=open]")
        page.fill("#input", "Hello")
        page.press("#input", "Enter")
        # The reply shown and rendered (live stats show with its first token, before the
        # Markdown comes back: waiting on them alone raced the bubble's text).
        wait_reply_done(page)
        assert page.locator(".message.assistant .bubble").inner_text() == "keyed reply"
        context.close()
        # A browser without the cookie gets the form, and its WebSocket is refused.
        stranger = browser.new_context().new_page()
        stranger.goto(parley.url)
        assert stranger.is_visible("form.login")
        ws = parley.url.replace("http", "ws") + "/ws"
        stranger.evaluate(f"() => {{ const w = new WebSocket('{ws}');"
                          "w.onopen = () => { document.title = 'open'; };"
                          "w.onerror = () => { document.title = 'refused'; }; }")  # fmt: skip
        stranger.wait_for_function("() => ['open', 'refused'].includes(document.title)")
        assert stranger.title() == "refused"
