"""Which requests may reach Parley at all: the Host allow-list and the cross-origin check.

Two attacks let a web page the user visits drive their local server:

- DNS rebinding: the page's own name (evil.example) is re-pointed at 127.0.0.1. The
  browser then sends the page's requests to Parley as same-origin ones, with `Host:
  evil.example`. Only the Host header tells them apart, so every request (every route,
  HTTP and WebSocket) must name a host we serve: the loopback names, the address we are
  bound to, and the names listed in --allowed-hosts. Bound to every address (0.0.0.0,
  ::), any IP literal is one of ours; an IP literal cannot be a rebound name either, since
  the page that sent it was loaded from that very address.
- Cross-origin requests: a page elsewhere may POST a `text/plain` body or open a
  WebSocket without asking first (no CORS preflight). It cannot read the answer, but the
  turn runs, with the visitor's cookies. Browsers name the page in `Origin` (and, in
  `Sec-Fetch-Site`, how it relates to us); a request whose Origin is neither the server's
  own nor listed in --allowed-origins is refused, and so is an unsafe method that a
  browser marks cross-site without an Origin.

Clients that are not browsers send no Origin and a Host of their choice: they are served
(keys, not this check, keep them out). `*` in the allowed hosts opts out of the Host check.

HostGuard is a pure ASGI middleware, outermost: a refused request reaches no handler and
no authentication, and streaming responses pass through it untouched.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
POLICY_VIOLATION = 1008  # a WebSocket refused before accept: the handshake gets a 403


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header -> (lower-case name without a trailing dot, port); None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:]
    else:
        name, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    if port and not port.isdigit():
        return None
    name = name.rstrip(".")
    return (name, int(port) if port else None) if name else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _origin_key(scheme: str, name: str, port: int | None) -> tuple[str, str, int | None]:
    return scheme, name, port if port != DEFAULT_PORTS.get(scheme) else None


def origin_key(origin: str) -> tuple[str, str, int | None] | None:
    """`scheme://host[:port]` -> a comparable triple, default ports dropped."""
    try:
        parts = urlsplit(origin.strip().rstrip("/").lower())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return _origin_key(parts.scheme, parts.hostname.rstrip("."), port)


@dataclass(frozen=True)
class HostPolicy:
    """The hosts and origins one server accepts. Build it with `HostPolicy.build`."""

    names: frozenset[str]  # exact host names and addresses
    suffixes: tuple[str, ...]  # ".example.org": that name and every name under it
    any_host: bool  # "*": no Host check
    any_ip: bool  # bound to every address: any IP literal is ours
    origins: frozenset[tuple[str, str, int | None]]  # besides the server's own
    null_origin: bool  # "null" listed in the allowed origins (sandboxed frames, file:)

    @classmethod
    def build(
        cls, bound: str, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()
    ) -> HostPolicy:
        """Loopback names and `bound` (the listening address), plus `allowed_hosts`.
        Raises ValueError for an origin that is not `scheme://host[:port]`."""
        names, suffixes, any_host = set(LOOPBACK_NAMES), [], False
        bound = bound.strip().strip("[]").lower()
        if bound not in WILDCARD_ADDRESSES:
            names.add(bound)
        for entry in allowed_hosts:
            entry = entry.strip().lower().rstrip(".")
            if entry == "*":
                any_host = True
            elif entry.startswith("."):
                suffixes.append(entry)
            elif entry:
                names.add(entry.strip("[]"))
        origins, null = set(), False
        for origin in allowed_origins:
            if origin.strip().lower() == "null":
                null = True
                continue
            key = origin_key(origin)
            if key is None:
                raise ValueError(f"allowed origin {origin!r} is not scheme://host[:port]")
            origins.add(key)
        return cls(frozenset(names), tuple(suffixes), any_host,
                   bound in WILDCARD_ADDRESSES, frozenset(origins), null)  # fmt: skip

    def host_ok(self, host: str | None) -> bool:
        """Whether a Host header names this server. No Host at all (HTTP/1.0, not a
        browser) cannot be a rebound name."""
        if host is None or self.any_host:
            return True
        parsed = split_host(host)
        if parsed is None:
            return False
        name = parsed[0]
        if name in self.names or any(name == s[1:] or name.endswith(s) for s in self.suffixes):
            return True
        return self.any_ip and _is_ip(name)

    def origin_ok(self, origin: str, host: str | None, scheme: str) -> bool:
        """The request's own origin (scheme and Host), or one allowed."""
        if origin.strip().lower() == "null":
            return self.null_origin
        key = origin_key(origin)
        if key is None:
            return False
        if key in self.origins:
            return True
        own = split_host(host) if host else None
        if own is None:
            return False
        scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        return key == _origin_key(scheme, *own)

    def describe(self) -> str:
        """For the start line: which Host names are served."""
        if self.any_host:
            return "any (--allowed-hosts *)"
        shown = sorted(self.names) + [f"*{s}" for s in self.suffixes]
        return ", ".join(shown) + (", any IP address" if self.any_ip else "")


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str
    message: str


def check(policy: HostPolicy, scope: Scope) -> Refusal | None:
    """Why a request may not proceed, or None."""
    headers: dict[str, list[str]] = {}
    for key, value in scope.get("headers", ()):
        headers.setdefault(key.decode("latin-1").lower(), []).append(value.decode("latin-1"))
    hosts = headers.get("host", [])
    host = hosts[0] if hosts else None
    if len(hosts) > 1 or not policy.host_ok(host):
        return Refusal(400, "host_not_allowed",
                       f"this server does not answer to the host {host!r}: add the name to "
                       "--allowed-hosts (PARLEY_ALLOWED_HOSTS) to serve it")  # fmt: skip
    origins = headers.get("origin", [])
    if origins and (len(origins) > 1 or not policy.origin_ok(origins[0], host, scope["scheme"])):
        return Refusal(403, "cross_origin",
                       f"requests from the page at {origins[0]!r} are refused: add that origin "
                       "to --allowed-origins to let it use this server")  # fmt: skip
    method = scope.get("method", "GET")
    fetch_site = headers.get("sec-fetch-site", [""])[0].lower()
    if not origins and method not in SAFE_METHODS and fetch_site in ("cross-site", "same-site"):
        return Refusal(403, "cross_origin", "a cross-site request without an Origin is refused")
    return None


class HostGuard:
    """ASGI middleware: refuse what `check` refuses, before anything else runs."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refusal = check(self.policy, scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        log.warning("refused %s %s from %s: %s", scope["type"], scope.get("path"), client[0],
                    refusal.code)  # fmt: skip
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            return
        body = {"error": {"message": refusal.message, "type": "invalid_request_error",
                          "param": None, "code": refusal.code}}  # fmt: skip
        await JSONResponse(body, status_code=refusal.status)(scope, receive, send)
