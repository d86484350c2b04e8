"""Who may connect: an optional API key, and the WebSocket Origin check.

- /v1 takes the key as `Authorization: Bearer <key>`.
- The chat page cannot put headers on a WebSocket, and a key in the URL would end up in
  logs. So the page asks for the key once (a form on its own origin) and gets an HttpOnly,
  SameSite=Strict cookie holding an HMAC of it; /ws accepts that cookie or the Bearer
  header (for non-browser clients).
- Every /ws handshake from a browser carries an Origin. One that is neither the page's own
  origin nor in the allow-list is refused: another site's page must not talk to Parley
  with its visitor's cookies (cross-site WebSocket hijacking).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from urllib.parse import urlsplit

COOKIE = "parley_auth"


class Access:
    """Checks for one server's key and allowed origins."""

    def __init__(self, api_key: str | None, allowed_origins: tuple[str, ...] = ()) -> None:
        self.api_key = api_key or None
        self.allowed_origins = {o.rstrip("/").lower() for o in allowed_origins}

    @property
    def enabled(self) -> bool:
        return self.api_key is not None

    def page_token(self) -> str:
        """The cookie value: proves the key was given, without being the key."""
        assert self.api_key is not None
        return hmac.new(self.api_key.encode(), b"parley-page", hashlib.sha256).hexdigest()

    def key_matches(self, candidate: str) -> bool:
        return self.api_key is not None and hmac.compare_digest(
            candidate.encode(), self.api_key.encode()
        )

    def bearer_ok(self, headers: Mapping[str, str]) -> bool:
        if not self.enabled:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and self.key_matches(token.strip())

    def cookie_ok(self, cookies: Mapping[str, str]) -> bool:
        if not self.enabled:
            return True
        return hmac.compare_digest(cookies.get(COOKIE, "").encode(), self.page_token().encode())

    def origin_ok(self, headers: Mapping[str, str], scheme: str) -> bool:
        """No Origin (not a browser), the page's own origin, or an allowed one."""
        origin = headers.get("origin")
        if origin is None:
            return True
        origin = origin.rstrip("/").lower()
        if origin in self.allowed_origins:
            return True
        host = headers.get("host", "").lower()
        parts = urlsplit(origin)
        own = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        return parts.scheme == own and parts.netloc == host
