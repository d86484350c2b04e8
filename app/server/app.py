"""create_app(): the Starlette application. Its lifespan owns the engine: it loads the
model, starts the engine loop, hands the chat service and the APIs to handlers as state,
and stops the loop on shutdown (no thread or task left behind). Handlers are plain
module-level functions that read `request.state`; who is asking is decided once, by
Starlette's authentication middleware (app.server.security)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from app.config import ClusterConfig, EngineConfig
from app.engine.protocol import EngineClient
from app.server import markdown, messages, openai_api, responses, tokenizer_api
from app.server.chat_service import ChatConfig, ChatService
from app.server.errors import APIError
from app.server.hosts import HostGuard, HostPolicy
from app.server.journal import Journal, JournalConfig
from app.server.metrics import CONTENT_TYPE, Metrics, ResumeCollector
from app.server.page import page_context
from app.server.security import (
    AUTH_COOKIE,
    CLIENT_COOKIE,
    CSRF_COOKIE,
    LOGIN_TTL_S,
    Access,
    ParleyAuth,
    Principal,
)
from app.server.shares import V1TurnShare
from app.server.streams import Streams, StreamsConfig
from app.server.turn_runner import TurnRunner
from app.server.ws import Connections, ws_endpoint

log = logging.getLogger(__name__)

# The page runs only our own scripts and styles: no inline script, no third-party origin.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'self'"
)


def asset_dir(name: str) -> Path:
    """static/ or templates/: inside the package in an installed wheel (the build maps
    them there), at the top of the repository in a checkout or an editable install."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"Parley's {name}/ folder is missing from {package}")


@dataclass(frozen=True)
class ServerConfig:
    """The web side: where to listen, who may connect, per-connection limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    chat: ChatConfig = field(default_factory=ChatConfig)
    otlp_endpoint: str | None = None  # OpenTelemetry traces go here when set
    api_key: str | None = None  # one tenant's key, required on /v1 and /ws
    api_keys: Mapping[str, bytes] | None = None  # several: tenant -> SHA-256 of its key
    allowed_hosts: tuple[str, ...] = ()  # besides loopback and `host`; "*": any (hosts.py)
    allowed_origins: tuple[str, ...] = ()  # besides the page's own origin (hosts.py)
    secret: bytes | None = None  # signs cookies; None: a new one per process
    login_ttl_s: float = LOGIN_TTL_S  # how long a page login lasts (or until its key changes)
    metrics_key: str | None = None  # /metrics wants it as a Bearer key; None: open
    streams: StreamsConfig = field(default_factory=StreamsConfig)  # resumable turns
    journal: JournalConfig | None = None  # durable turns on Redis Streams
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # replicas > 1: on Ray

    def host_policy(self) -> HostPolicy:
        return HostPolicy.build(self.host, self.allowed_hosts, self.allowed_origins)

    def chat_config(self) -> ChatConfig:
        """`chat`, with prefix-cache isolation decided where it was left open: on when
        several tenants share the server (one tenant's prompts must not show in another's
        cached_tokens or timings), off otherwise."""
        if self.chat.isolate_prefix_cache is not None:
            return self.chat
        return replace(self.chat, isolate_prefix_cache=len(self.api_keys or {}) > 1)

    def describe(self) -> list[str]:
        """What the person starting the server should know: who can reach it, and what
        its users can learn of each other."""
        lines = [f"answers to the Host names {self.host_policy().describe()}"]
        tenants = len(self.api_keys or {}) or (1 if self.api_key else 0)
        if self.chat_config().isolate_prefix_cache:
            per = "tenant" if tenants else "browser client"
            count = f" ({tenants} tenants)" if tenants > 1 else ""
            lines.append(f"prefix cache isolated per {per}{count}")
        elif tenants > 1:
            lines.append(
                f"prefix cache SHARED by {tenants} tenants: cached_tokens and timings can "
                "tell one what another asked (--prefix-cache-isolation tenant isolates them)"
            )
        if tenants and not self.metrics_key:
            lines.append("/metrics is open to whoever reaches the server (--metrics-key)")
        return lines

    def access(self) -> Access:
        if self.api_key and self.api_keys:
            raise ValueError("give one API key or a keys file, not both")
        kw: dict[str, Any] = {"secret": self.secret, "login_ttl_s": self.login_ttl_s}
        if self.api_keys:
            return Access(self.api_keys, **kw)
        return Access.single_key(self.api_key, **kw)


# -- handlers --------------------------------------------------------------------------------


def _page(request: Request, template: str, context: dict[str, Any], status: int = 200):
    response = request.state.templates.TemplateResponse(
        request, template, context, status_code=status
    )
    response.headers["Content-Security-Policy"] = CSP
    return response


def _login_page(request: Request, error: str | None = None, status: int = 200) -> Response:
    """The key form, with a token that goes with a cookie set now (login CSRF)."""
    cookie, token = request.state.access.csrf_pair()
    response = _page(request, "login.html", {"error": error, "csrf": token}, status)
    secure = request.url.scheme == "https"
    response.set_cookie(CSRF_COOKIE, cookie, httponly=True, samesite="strict", path="/login",
                        secure=secure)  # fmt: skip
    return response


async def index(request: Request) -> Response:
    principal = request.user
    if not isinstance(principal, Principal):
        return _login_page(request)
    response = _page(request, "index.html", page_context(request.state.engine.info))
    if principal.new_client_cookie:  # this browser's lineage: it owns its conversations
        response.set_cookie(CLIENT_COOKIE, principal.new_client_cookie, httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")  # fmt: skip
    return response


async def login(request: Request) -> Response:
    access: Access = request.state.access
    if not access.enabled:
        return RedirectResponse("/", status_code=303)
    form = await request.form()
    if not access.csrf_ok(request.cookies.get(CSRF_COOKIE), form.get("csrf")):
        return _login_page(request, "This form came from elsewhere or expired: try again.", 403)
    key = form.get("key")
    tenant = access.tenant_for_key(key) if isinstance(key, str) else None
    if tenant is None:
        return _login_page(request, "That key is not right.", 401)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(AUTH_COOKIE, access.page_cookie(tenant), max_age=int(access.login_ttl_s),
                        httponly=True, samesite="strict", path="/",
                        secure=request.url.scheme == "https")  # fmt: skip
    response.delete_cookie(CSRF_COOKIE, path="/login")
    return response


async def health(request: Request) -> Response:
    """The process is up."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """The model is loaded and the engine can serve."""
    if request.state.engine.healthy():
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "engine not running"}, status_code=503)


async def metrics(request: Request) -> Response:
    if not request.state.metrics.allows(request.headers.get("authorization", "")):
        message = "/metrics wants the metrics key: Authorization: Bearer <key>"
        bearer = {"WWW-Authenticate": "Bearer"}
        return APIError(401, message, code="invalid_api_key", headers=bearer).response()
    return Response(request.state.metrics.render(), media_type=CONTENT_TYPE)


# -- the app ---------------------------------------------------------------------------------


def create_app(
    engine_config: EngineConfig | None = None,
    server_config: ServerConfig | None = None,
    engine: EngineClient | None = None,
    listeners: list[Any] | None = None,
) -> Starlette:
    """Build the app. `engine` (anything behind EngineClient) replaces the one the
    lifespan would otherwise build from `engine_config`; `listeners` (engine listeners,
    e.g. a RequestTracer) are attached to it besides the metrics."""
    server_config = server_config or ServerConfig()
    access = server_config.access()
    templates = Jinja2Templates(directory=str(asset_dir("templates")))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        eng = engine
        if eng is None:
            eng = await asyncio.to_thread(
                _build_engine, engine_config or EngineConfig(), server_config.cluster
            )
        metrics = Metrics(eng, server_config.metrics_key)
        extra = list(listeners or [])
        if server_config.otlp_endpoint:
            from app.server.tracing import RequestTracer

            extra.append(RequestTracer.to_endpoint(server_config.otlp_endpoint))
        for listener in [metrics, *extra]:
            eng.add_listener(listener)
        chat = ChatService(eng, server_config.chat_config())
        streams = Streams(server_config.streams)
        journal = Journal(server_config.journal) if server_config.journal else None
        runner = TurnRunner(chat, streams, journal)
        metrics.registry.register(ResumeCollector(streams, journal))
        eng.start()
        upkeep = None
        if journal is not None:
            for turn in await journal.open():  # this server's turns from before a restart
                runner.recover(turn)
            upkeep = asyncio.create_task(_keep_journal(journal, runner))
        try:
            yield {
                "access": access,
                "chat": chat,
                "engine": eng,
                "markdown": markdown.MarkdownRenderer(),
                "metrics": metrics,
                "openai": openai_api.OpenAIAPI(eng, chat.prompt, chat.cache_salt),
                "responses": responses.ResponsesAPI(chat),
                "messages": messages.MessagesAPI(chat),
                "tokenizer_api": tokenizer_api.TokenizerAPI(chat),
                "templates": templates,
                "turns": runner,
                "connections": Connections(
                    chat.config.max_connections, chat.config.max_connections_per_client
                ),
            }
        finally:
            runner.closing = True  # journaled turns in flight stay pending for the next process
            if upkeep is not None:
                upkeep.cancel()
            await eng.stop()
            await runner.wait()
            streams.close()
            if journal is not None:
                await journal.close()
            for listener in extra:
                listener.shutdown()

    routes = [
        Route("/", index),
        Route("/login", login, methods=["POST"]),
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        *openai_api.routes(),
        *responses.routes(),
        *messages.routes(),
        *tokenizer_api.routes(),
        *markdown.routes(),
        WebSocketRoute("/ws", ws_endpoint),
        Mount("/static", StaticFiles(directory=str(asset_dir("static"))), name="static"),
    ]
    middleware = [
        Middleware(HostGuard, policy=server_config.host_policy()),  # first: DNS rebinding
        Middleware(AuthenticationMiddleware, backend=ParleyAuth(access)),
        Middleware(V1TurnShare),  # a client's /v1 requests count against its turn share
    ]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)


async def _keep_journal(journal: Journal, runner: TurnRunner) -> None:
    """Heartbeat, trim, reconnect, and take up turns of processes that went silent."""
    every = journal.config.claim_after_s / 3
    while True:
        await asyncio.sleep(every if journal.up else min(every, 1.0))
        try:
            await runner.keep_journal()
        except Exception:
            log.exception("journal upkeep failed; trying again")


def _build_engine(config: EngineConfig, cluster: ClusterConfig) -> EngineClient:
    if cluster.replicas > 1:  # Ray is imported here and only here
        try:
            from app.cluster.cluster import RayCluster
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise RuntimeError(
                "--replicas > 1 runs engine replicas on Ray: pip install 'parley[cluster]'"
            ) from None
        return RayCluster(config, cluster)
    from app.engine.async_engine import AsyncEngine

    return AsyncEngine.build(config)  # on a thread of its own: see AsyncEngine's docstring
