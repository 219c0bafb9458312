"""Cross-origin requests (CORS): which web pages may call the gateway from a browser.

Off unless `cors_origins` names origins (or `*`): then every answer says `Vary: Origin`, an answer to an
allowed Origin says `Access-Control-Allow-Origin` and the headers a page may read, and a preflight (OPTIONS
with Access-Control-Request-Method) is answered 204 here, before auth and routing: it carries no credentials,
and the request it asks about is checked when it comes. An origin not allowed gets no CORS headers (the
browser then blocks the page's request), not an error. No Access-Control-Allow-Credentials: the API's
credentials are an Authorization header a page sets itself, not cookies.

The infer routes answered from the parser (protocol.py) add `headers()` to their answers; the others go
through `CorsMiddleware`. Answers that end a connection before any route has the request (connection.py's:
a malformed request's 400, 408, 431, the 503 past the connection limit) and an unhandled fault's 500
(Starlette's outermost middleware) carry none.
"""
from __future__ import annotations

from ..settings import Settings
from .auth import AuthPolicy
from .http import Headers, Receive, Scope, Send, header

# What a page may send: the safelisted headers a browser still asks about (Content-Type: application/json
# is not safelisted), the API's credentials and request headers, and the body's encoding
ALLOW_HEADERS = ("accept", "accept-language", "content-language", "content-type", "content-encoding",
                 "authorization", "inference-header-content-length", "x-request-id")
# What a page may read of an answer besides the safelisted ones (Content-Type, Content-Length...): where a
# binary answer's JSON ends, the request's id, and when to try again after a 503
EXPOSE_HEADERS = b"inference-header-content-length, x-request-id, retry-after"
ALLOW_METHODS = b"GET, POST"  # every route's method (the router answers another one 405)
VARY = (b"vary", b"Origin")


class CorsPolicy:
    """The allowed origins and request headers, with the answers' headers made once."""

    def __init__(self, origins: frozenset[str] | None, allow_headers: frozenset[str], max_age_s: int) -> None:
        self.origins = None if origins is None else frozenset(o.encode() for o in origins)  # None: any
        self.allow_headers = allow_headers
        self.max_age = str(max_age_s).encode()
        self.plain: Headers = [VARY]  # an answer to a request with no Origin, or one not allowed

    @classmethod
    def from_settings(cls, settings: Settings, auth: AuthPolicy) -> CorsPolicy | None:
        """None where CORS is off: the answers stay as they were, byte for byte."""
        origins = [o.strip().lower() for o in settings.cors_origins.split(",") if o.strip()]
        if not origins:
            return None
        extra = {h.strip().lower() for h in settings.cors_allow_headers.split(",") if h.strip()}
        # a Triton restricted API's header must reach the gateway from a page too
        restricted = {r.header.decode() for r in auth.restricted.values()}
        return cls(None if origins == ["*"] else frozenset(origins),
                   frozenset(ALLOW_HEADERS) | extra | restricted, settings.cors_max_age_s)

    def allowed(self, origin: bytes | None) -> bool:
        return origin is not None and (self.origins is None or origin in self.origins)

    def headers(self, request: Headers) -> Headers:
        """The CORS headers of an answer to this request (not a preflight's)."""
        origin = header(request, b"origin")
        if not self.allowed(origin):
            return self.plain
        assert origin is not None
        return [(b"access-control-allow-origin", b"*" if self.origins is None else origin),
                (b"access-control-expose-headers", EXPOSE_HEADERS), VARY]

    def preflight(self, request: Headers) -> Headers:
        """A preflight's answer headers: what the page may send, for how long the browser may remember it."""
        origin = header(request, b"origin")
        if not self.allowed(origin):
            return self.plain
        assert origin is not None
        asked = header(request, b"access-control-request-headers") or b""
        names = [n.strip().lower() for n in asked.decode("latin-1").split(",")]
        granted = ", ".join(n for n in dict.fromkeys(names) if n in self.allow_headers).encode()
        out = [(b"access-control-allow-origin", b"*" if self.origins is None else origin),
               (b"access-control-allow-methods", ALLOW_METHODS),
               (b"access-control-max-age", self.max_age), VARY]
        if granted:  # a name left out: the browser refuses to send the request, as it should
            out.append((b"access-control-allow-headers", granted))
        return out


def is_preflight(scope: Scope) -> bool:
    if scope["method"] != "OPTIONS":
        return False
    headers = scope["headers"]
    return header(headers, b"origin") is not None and \
        header(headers, b"access-control-request-method") is not None


class CorsMiddleware:
    """ASGI middleware, outside auth: answers preflights, and adds the CORS headers to every other answer
    (a 401 or 404 too, so that the page can read why)."""

    def __init__(self, app: object, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # type: ignore[operator]
            return
        if is_preflight(scope):
            headers = self.policy.preflight(scope["headers"])
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        cors = self.policy.headers(scope["headers"])

        async def send_with_cors(message: dict[str, object]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *cors]  # type: ignore[misc]
            await send(message)

        await self.app(scope, receive, send_with_cors)  # type: ignore[operator]
