"""Who is asking: tenants (API keys), browser lineages, and the WebSocket Origin check.

Every request gets a Principal from Starlette's authentication middleware (ParleyAuth):

- With API keys (`--api-key`, or several named ones in `--api-keys-file`), the principal is
  the key's tenant. /v1 takes the key as `Authorization: Bearer <key>` (or `x-api-key:
  <key>`, as Anthropic's clients send it); the chat page,
  which cannot put headers on a WebSocket (and must not put a key in a URL, where logs
  keep it), asks for the key once and gets an HttpOnly, SameSite=Strict cookie naming the
  tenant and an expiry under an HMAC bound to the key's digest (Secure over TLS); /ws
  accepts that cookie or the Bearer header. The cookie secret is shared by a user's
  servers (persistent_secret), so the binding is what makes a rotated key, or a tenant
  removed from the key set, revoke the cookies it issued once the server restarts with
  the new set. The login form carries a token that goes with a cookie of its own (login
  CSRF). Keys are kept only as SHA-256 digests.
- Without keys everyone is let in, and a conversation belongs to the browser that started
  it: the page (and /ws) hand out a client cookie, a random id under an HMAC, so a reload
  keeps the lineage. A client that keeps no cookies is its own socket.

A conversation is bound to the principal's `owner` (see chat_service): nobody else can
continue it from the server's memory, delete it or resume its stream. Tenants are
separate namespaces altogether.

Which hosts and origins may send requests at all (DNS rebinding, cross-site requests) is
decided before this, by app.server.hosts.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from starlette.authentication import AuthCredentials, AuthenticationBackend, BaseUser
from starlette.requests import HTTPConnection

AUTH_COOKIE = "parley_auth"  # a tenant's page login
CLIENT_COOKIE = "parley_client"  # a browser lineage, without keys
CSRF_COOKIE = "parley_csrf"  # goes with the login form's token
DEFAULT_TENANT = "default"  # the tenant of a single --api-key
LOGIN_TTL_S = 7 * 86400.0  # a page login lasts a week, or until its key changes


@dataclass(frozen=True)
class Principal(BaseUser):
    """Who sent a request. `tenant` is "" without API keys; `owner` is who owns the
    conversations it starts (the tenant, a browser lineage, or one socket)."""

    tenant: str
    owner: str
    new_client_cookie: str | None = None  # a lineage begun now: send this cookie back
    share: str = ""  # whose share of sockets and turns it uses (app.server.shares); "": none

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.tenant or "anonymous"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _b64(text: str) -> str:  # tenant names in cookie values: no ";", ",", "." or "~"
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


def _unb64(text: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def persistent_secret(folder: Path) -> bytes:
    """The key that signs cookies, kept in `folder` (readable by its owner only) so that
    browsers keep their lineage, and their conversations, across restarts."""
    path = folder / "cookie-secret"
    try:
        secret = path.read_bytes()
        if len(secret) == 32:
            return secret
    except FileNotFoundError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_bytes(secret)
    tmp.replace(path)
    return secret


def parse_keys_file(path: Path) -> dict[str, bytes]:
    """Tenants and key digests from a file of `name key` lines (`name sha256:<hex>` for a
    key given as its digest; `#` starts a comment). Raises ValueError on a bad line."""
    keys: dict[str, bytes] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'name key', got {len(parts)} fields")
        name, key = parts
        if name in keys:
            raise ValueError(f"{path}:{number}: tenant {name!r} is listed twice")
        if key.startswith("sha256:"):
            try:
                digest = bytes.fromhex(key.removeprefix("sha256:"))
            except ValueError:
                raise ValueError(f"{path}:{number}: not a hex digest") from None
            if len(digest) != 32:
                raise ValueError(f"{path}:{number}: a sha256 digest has 64 hex digits")
        else:
            digest = _digest(key)
        keys[name] = digest
    if not keys:
        raise ValueError(f"{path} lists no keys")
    return keys


class Access:
    """One server's keys and cookie secret. `clock` (wall time, seconds) dates cookies."""

    def __init__(
        self,
        keys: Mapping[str, bytes] | None = None,
        secret: bytes | None = None,
        login_ttl_s: float = LOGIN_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keys = dict(keys or {})  # tenant -> SHA-256 of its key
        self._tenants = {digest: name for name, digest in self._keys.items()}
        self._secret = secret or secrets.token_bytes(32)
        self.login_ttl_s = login_ttl_s
        self._clock = clock

    @classmethod
    def single_key(cls, api_key: str | None, **kw) -> Access:
        return cls({DEFAULT_TENANT: _digest(api_key)} if api_key else None, **kw)

    @property
    def enabled(self) -> bool:
        """Whether API keys are required."""
        return bool(self._tenants)

    @property
    def tenants(self) -> int:
        return len(self._keys)

    def key_digest(self, tenant: str) -> bytes | None:
        return self._keys.get(tenant)

    def tenant_for_key(self, key: str) -> str | None:
        digest = _digest(key)
        for known, name in self._tenants.items():
            if hmac.compare_digest(known, digest):
                return name
        return None

    # -- signed cookie values: "<value>.<mac>" ---------------------------------------------

    def _sign(self, kind: str, value: str, bound: bytes = b"") -> str:
        message = f"{kind}:{value}:".encode() + bound
        mac = hmac.new(self._secret, message, hashlib.sha256).hexdigest()
        return f"{value}.{mac[:32]}"

    def _verify(self, kind: str, cookie: str | None) -> str | None:
        if not cookie or "." not in cookie:
            return None
        value = cookie.rsplit(".", 1)[0]
        return value if hmac.compare_digest(self._sign(kind, value), cookie) else None

    def page_cookie(self, tenant: str) -> str:
        """The login cookie: proves the tenant's key was given, without being the key.
        It names the tenant and its expiry, under a MAC that also covers the key's digest,
        so that it dies with the key: a server started with another key for the tenant
        (or without the tenant) refuses it."""
        expires = int(self._clock() + self.login_ttl_s)
        return self._sign("tenant", f"{_b64(tenant)}~{expires}", self._keys[tenant])

    def _page_tenant(self, cookie: str | None) -> str | None:
        if not cookie or cookie.count(".") != 1:
            return None
        value = cookie.split(".", 1)[0]
        name, sep, expires = value.partition("~")
        tenant = _unb64(name)
        digest = self._keys.get(tenant) if tenant is not None else None
        if digest is None or not sep or not expires.isdigit():
            return None
        if not hmac.compare_digest(self._sign("tenant", value, digest), cookie):
            return None
        return tenant if self._clock() < int(expires) else None

    def new_client_cookie(self) -> str:
        return self._sign("client", secrets.token_hex(16))

    def csrf_pair(self) -> tuple[str, str]:
        """A login form's cookie and the token its page carries: a cross-site form post
        has neither the cookie (SameSite=Strict) nor a token that goes with one."""
        nonce = secrets.token_hex(16)
        return nonce, self._sign("csrf", nonce).rsplit(".", 1)[1]

    def csrf_ok(self, cookie: str | None, token: object) -> bool:
        if not cookie or not isinstance(token, str):
            return False
        return hmac.compare_digest(self._sign("csrf", cookie), f"{cookie}.{token}")

    # -- who is asking ---------------------------------------------------------------------

    def authenticate(
        self, headers: Mapping[str, str], cookies: Mapping[str, str], address: str = ""
    ) -> Principal | None:
        """The principal of a request from `address`, or None when a key is required and
        missing. Its share is its tenant's or, without keys, its address's."""
        if self.enabled:
            tenant = None
            scheme, _, token = headers.get("authorization", "").partition(" ")
            api_key = headers.get("x-api-key", "").strip()  # Anthropic's clients send this
            if scheme.lower() == "bearer" and token.strip():
                tenant = self.tenant_for_key(token.strip())
            elif api_key:
                tenant = self.tenant_for_key(api_key)
            else:
                tenant = self._page_tenant(cookies.get(AUTH_COOKIE))
            owner = f"tenant:{tenant}"
            return None if tenant is None else Principal(tenant, owner, share=owner)
        share = f"address:{address}" if address else ""
        client = self._verify("client", cookies.get(CLIENT_COOKIE))
        if client is not None:
            return Principal("", f"client:{client}", share=share or f"client:{client}")
        cookie = self.new_client_cookie()
        owner = f"client:{cookie.rsplit('.', 1)[0]}"
        return Principal("", owner, new_client_cookie=cookie, share=share or owner)


class ParleyAuth(AuthenticationBackend):
    """Starlette's authentication middleware backend: `request.user` is a Principal, or
    unauthenticated when a key is required and none was given."""

    def __init__(self, access: Access) -> None:
        self.access = access

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, Principal] | None:
        address = conn.client.host if conn.client else ""
        principal = self.access.authenticate(conn.headers, conn.cookies, address)
        if principal is None:
            return None
        return AuthCredentials(["authenticated"]), principal
