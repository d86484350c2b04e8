"""Per-client shares of the server: open sockets, and turns in flight (on /ws and /v1).

The global limits (--max-connections, the engine's queue) protect the server; they do
not stop one client from taking all of it, so that every other client is told `busy`.
Each client also gets a share of its own. Who is "a client" is the Principal's `share`
(app.server.security): with keys, the tenant (its key); without, the address the request
came from. Not the browser cookie: anyone can mint a new lineage by loading the page
again. Behind a reverse proxy, the address is the one uvicorn takes from
X-Forwarded-For when it trusts the proxy (FORWARDED_ALLOW_IPS), else the proxy's own.

Counters live on the event loop only (no locks).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from app.server.errors import APIError


class Share:
    """At most `limit` of something per client. An empty key is nobody's (a turn taken
    over from the journal) and is not counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def take(self, key: str) -> bool:
        """Count one more for `key`; False (and nothing counted) when its share is full."""
        if not key:
            return True
        held = self._held.get(key, 0)
        if held >= self.limit:
            return False
        self._held[key] = held + 1
        return True

    def release(self, key: str) -> None:
        if not key:
            return
        held = self._held.get(key, 0) - 1
        if held > 0:
            self._held[key] = held
        else:
            self._held.pop(key, None)

    def held(self, key: str) -> int:
        return self._held.get(key, 0)


class V1TurnShare:
    """ASGI middleware (inside authentication): each /v1 request that generates counts
    as a turn of its client while it runs (a streamed response until its last byte)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        share_key = getattr(scope.get("user"), "share", "")  # "" before authentication
        generates = scope["type"] == "http" and scope["method"] == "POST"
        if not (generates and share_key and scope["path"].startswith("/v1/")):
            await self.app(scope, receive, send)
            return
        turns: Share = scope["state"]["chat"].turns
        if not turns.take(share_key):
            err = APIError(429, f"this client has {turns.limit} requests and turns in flight "
                           "(its share: --max-turns-per-client); retry when one ends",
                           "rate_limit_error", code="too_many_turns",
                           headers={"Retry-After": "1"})  # fmt: skip
            await err.response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            turns.release(share_key)
