"""create_app(): the Starlette application. Its lifespan owns the engine: it loads the
model, starts the engine loop, hands the chat service to handlers as state, and stops the
loop on shutdown (no thread or task left behind)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from app.config import EngineConfig
from app.server import openai_api
from app.server.metrics import CONTENT_TYPE, Metrics
from app.server.security import COOKIE, Access
from app.server.turns import ChatConfig, ChatService
from app.server.ws import ws_endpoint

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent.parent
STATIC_DIR = ROOT / "static"
TEMPLATES_DIR = ROOT / "templates"

# The page runs only our own scripts and styles: no inline script, no third-party origin.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'self'"
)


@dataclass(frozen=True)
class ServerConfig:
    """The web side: where to listen and per-connection limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    chat: ChatConfig = field(default_factory=ChatConfig)
    otlp_endpoint: str | None = None  # OpenTelemetry traces go here when set
    api_key: str | None = None  # required on /v1 (Bearer) and /ws (cookie or Bearer)
    allowed_origins: tuple[str, ...] = ()  # besides the page's own origin, for /ws


def create_app(
    engine_config: EngineConfig | None = None,
    server_config: ServerConfig | None = None,
    engine: Any = None,
    listeners: list[Any] | None = None,
) -> Starlette:
    """Build the app. `engine` (an AsyncEngine or a fake with its interface) replaces the
    one the lifespan would otherwise build from `engine_config`; `listeners` (engine
    listeners, e.g. a RequestTracer) are attached to it besides the metrics."""
    server_config = server_config or ServerConfig()
    templates = Jinja2Templates(directory=str(TEMPLATES_DIR))
    access = Access(server_config.api_key, server_config.allowed_origins)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        eng = engine
        if eng is None:
            eng = await asyncio.to_thread(_build_engine, engine_config or EngineConfig())
        metrics = Metrics(eng)
        extra = list(listeners or [])
        if server_config.otlp_endpoint:
            from app.server.tracing import RequestTracer

            extra.append(RequestTracer.to_endpoint(server_config.otlp_endpoint))
        if hasattr(eng, "add_listener"):
            for listener in [metrics, *extra]:
                eng.add_listener(listener)
        chat = ChatService(eng, server_config.chat)
        model_name = getattr(eng, "model_name", "model")
        eng.start()
        try:
            yield {
                "access": access,
                "chat": chat,
                "engine": eng,
                "metrics": metrics,
                "openai": openai_api.OpenAIAPI(eng, chat.prompt, model_name),
            }
        finally:
            await eng.stop()
            for listener in extra:
                if hasattr(listener, "shutdown"):
                    listener.shutdown()

    async def index(request: Request) -> Response:
        if not access.cookie_ok(request.cookies):
            return login_page(request)
        engine_ = request.state.engine
        response = templates.TemplateResponse(
            request,
            "index.html",
            {"model_name": getattr(engine_, "model_name", "model")},
        )
        response.headers["Content-Security-Policy"] = CSP
        return response

    def login_page(request: Request, error: str | None = None) -> Response:
        response = templates.TemplateResponse(
            request, "login.html", {"error": error}, status_code=401 if error else 200
        )
        response.headers["Content-Security-Policy"] = CSP
        return response

    async def login(request: Request) -> Response:
        form = await request.form()
        key = form.get("key")
        if not access.enabled:
            return RedirectResponse("/", status_code=303)
        if not isinstance(key, str) or not access.key_matches(key):
            return login_page(request, "That key is not right.")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, access.page_token(), httponly=True, samesite="strict", path="/")
        return response

    async def health(request: Request) -> Response:
        """The process is up."""
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        """The model is loaded and the engine loop is alive."""
        if request.state.engine.is_running:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(request.state.metrics.render(), media_type=CONTENT_TYPE)

    routes = [
        Route("/", index),
        Route("/login", login, methods=["POST"]),
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        *openai_api.routes(),
        WebSocketRoute("/ws", ws_endpoint),
        Mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static"),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def _build_engine(config: EngineConfig):
    from app.engine.async_engine import AsyncEngine
    from app.engine.engine import LLMEngine

    return AsyncEngine(LLMEngine(config))
