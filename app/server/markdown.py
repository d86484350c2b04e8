"""Model replies as HTML for the chat page: CommonMark with GFM tables and strikethrough
(markdown-it-py), code blocks highlighted by Pygments, and POST /render, which the page
calls as a reply streams in and when it shows a conversation.

Model text never becomes markup: raw HTML in a reply is escaped (markdown-it's `html`
option is off), links are kept only for http(s) and mailto targets and open in a new tab
without an opener, images become plain links (a remote image would load by itself, which
a prompt-injected reply could use to send a conversation away), and nothing carries a
`style` attribute (the page's CSP refuses them): table alignment becomes a class. The
page sets the HTML as it comes; tests/server/test_markdown.py throws hostile payloads at
the renderer and checks every tag and attribute against ALLOWED.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.server.security import Principal

MAX_BODY_BYTES = 4 << 20
MAX_TEXTS = 2000
SAFE_SCHEMES = ("http:", "https:", "mailto:")

# What the renderer may produce: tag -> the attributes it may carry.
ALLOWED: dict[str, frozenset[str]] = {
    **{t: frozenset() for t in ("p", "br", "strong", "em", "s", "blockquote", "hr", "ul", "li",
                                "h1", "h2", "h3", "h4", "h5", "h6", "thead", "tbody", "tr")},
    "ol": frozenset({"start"}),
    "a": frozenset({"href", "title", "target", "rel"}),
    "code": frozenset({"class"}),
    "pre": frozenset(),
    "span": frozenset({"class"}),  # Pygments' token classes
    "table": frozenset(),
    "th": frozenset({"class"}),
    "td": frozenset({"class"}),
}  # fmt: skip


class MarkdownRenderer:
    """Markdown -> HTML, with the rules above. One instance is safe to share: markdown-it
    keeps no state between calls."""

    def __init__(self) -> None:
        md = MarkdownIt("commonmark", {"html": False, "breaks": True, "highlight": _highlight})
        md.enable(["table", "strikethrough"])
        md.disable("image")
        md.validateLink = _safe_link
        rules = md.add_render_rule
        rules("link_open", _link_open)
        for tag in ("th_open", "td_open"):
            rules(tag, _cell_open)
        self._md = md

        self.css = highlight_css()

    def render(self, text: str) -> str:
        return self._md.render(text)


def _safe_link(url: str) -> bool:
    return url.strip().lower().startswith(SAFE_SCHEMES)


def _link_open(self, tokens, idx, options, env) -> str:
    token = tokens[idx]
    token.attrSet("target", "_blank")
    token.attrSet("rel", "noopener noreferrer nofollow")
    return self.renderToken(tokens, idx, options, env)


def _cell_open(self, tokens, idx, options, env) -> str:
    token = tokens[idx]
    style = token.attrs.pop("style", None)
    if isinstance(style, str) and style.startswith("text-align:"):
        token.attrSet("class", "align-" + style.split(":", 1)[1].strip())
    return self.renderToken(tokens, idx, options, env)


_FORMATTER = HtmlFormatter(nowrap=True)


@functools.lru_cache(maxsize=64)
def _lexer(lang: str):
    try:
        return get_lexer_by_name(lang, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return None


def _highlight(code: str, lang: str, attrs: str) -> str:
    """Pygments' spans for a fenced block whose info string names a language it knows;
    "" leaves the block to markdown-it, which escapes it as plain code."""
    lexer = _lexer(lang.lower()[:40]) if lang else None
    return highlight(code, lexer, _FORMATTER) if lexer is not None else ""


LIGHT_STYLE, DARK_STYLE = "default", "github-dark"


def highlight_css() -> str:
    """Pygments' token colours, its light style for the light theme and its dark one under
    [data-theme=dark]; the block's background stays the page's own."""
    out = []
    for style, scope in ((LIGHT_STYLE, ".bubble pre code"),
                         (DARK_STYLE, '[data-theme="dark"] .bubble pre code')):  # fmt: skip
        for line in HtmlFormatter(style=style).get_style_defs(scope).splitlines():
            if line.startswith(scope + " ."):  # token classes only
                out.append(line)
    return "\n".join(out) + "\n"


# -- POST /render --------------------------------------------------------------------------


async def render_endpoint(request: Request) -> Response:
    """{"texts": [markdown, ...]} -> {"html": [html, ...]}, rendered off the event loop."""
    if not isinstance(request.user, Principal):
        return JSONResponse({"error": "a valid key is required"}, status_code=401)
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        return JSONResponse({"error": f"body over {MAX_BODY_BYTES} bytes"}, status_code=413)
    texts = _texts(raw)
    if texts is None:
        return JSONResponse(
            {"error": f'expected {{"texts": [string, ...]}} with at most {MAX_TEXTS} texts'},
            status_code=400,
        )
    renderer: MarkdownRenderer = request.state.markdown
    html = await asyncio.to_thread(lambda: [renderer.render(t) for t in texts])
    return JSONResponse({"html": html})


def _texts(raw: bytes) -> list[str] | None:
    try:
        body: Any = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    texts = body.get("texts") if isinstance(body, dict) else None
    if not isinstance(texts, list) or len(texts) > MAX_TEXTS:
        return None
    if not all(isinstance(t, str) for t in texts):
        return None
    try:
        for t in texts:
            t.encode("utf-8")  # a lone surrogate ("\\ud800") cannot be answered
    except UnicodeEncodeError:
        return None
    return texts


async def css_endpoint(request: Request) -> Response:
    return Response(request.state.markdown.css, media_type="text/css")


def routes() -> list[Route]:
    return [
        Route("/render", render_endpoint, methods=["POST"]),
        Route("/highlight.css", css_endpoint),
    ]
