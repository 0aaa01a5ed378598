"""The dashboard's HTTP side: an aiohttp app that serves the page (package data under
static/), the read-only JSON API and a server-sent event stream, all from the
`Poller`'s memory (no request reads Redis).

    GET /                         the fleet page         (static/index.html)
    GET /service/{name}           the service page       (the same page; JS routes)
    GET /static/{file}            app.js, style.css
    GET /api/fleet                every service's row    (JSON)
    GET /api/services/{name}      one service's document with its chart history
    GET /api/stream[?service=N]   server-sent events: the fleet (or N's doc and one
                                  sample) after every poll
    GET /healthz                  "ok"

Read-only: every method but GET and HEAD is 405 (`Allow: GET, HEAD`), on every path.
Access (`DashboardConfig.check`): bound to loopback, no token is needed but the Host
header must name loopback (a DNS-rebinding page cannot read it); on any other address
a token (`Authorization: Bearer T`, or `?token=T` once, which sets an HttpOnly
SameSite=Strict cookie) or TLS is required. Tokens are compared in constant time.
Every response carries a strict Content-Security-Policy (scripts and styles from this
origin only, no inline script), so a string from Redis can never run as code even if
the page failed to escape it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import msgspec
from aiohttp import web

from controlplane.dashboard.poller import Poller
from proxy.wire.errors import SluiceError

STATIC = Path(str(resources.files("controlplane.dashboard") / "static"))
COOKIE = "sluice_dashboard"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
READ_METHODS = frozenset({"GET", "HEAD"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
#: How long an event stream waits for a poll before sending a keep-alive comment.
STREAM_KEEPALIVE = 15.0
#: Event streams open at once (each holds a connection and a task); more get a 503.
MAX_STREAMS = 64
_ENCODER = msgspec.json.Encoder()

class DashboardConfigError(SluiceError, ValueError):
    """An unsafe or inconsistent dashboard configuration (one line for the CLI)."""


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class DashboardConfig:
    """Where the dashboard listens and who may read it."""

    host: str = "127.0.0.1"
    port: int = 8090
    token: str | None = None
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    interval: float = 1.0

    @property
    def tls(self) -> bool:
        return bool(self.tls_certfile or self.tls_keyfile)

    def check(self) -> list[str]:
        """Raise DashboardConfigError when the config is unsafe; return warnings."""
        if bool(self.tls_certfile) != bool(self.tls_keyfile):
            raise DashboardConfigError("--tls-certfile and --tls-keyfile go together")
        if self.token is not None and len(self.token) < 16:
            raise DashboardConfigError("--token: use at least 16 characters")
        warnings = []
        if not is_loopback(self.host):
            if self.token is None and not self.tls:
                raise DashboardConfigError(
                    f"--host {self.host} is not loopback: give --token (or "
                    "SLUICE_DASHBOARD_TOKEN) or --tls-certfile/--tls-keyfile"
                )
            if self.token is None:
                warnings.append("no --token: anyone who reaches the port can read the fleet")
            if not self.tls:
                warnings.append("no TLS: the token crosses the network in clear text")
        return warnings

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls or not (self.tls_certfile and self.tls_keyfile):
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(os.path.expanduser(self.tls_certfile),
                                os.path.expanduser(self.tls_keyfile))  # fmt: skip
        except (OSError, ssl.SSLError) as exc:
            raise DashboardConfigError(f"cannot load TLS certificate/key: {exc}") from exc
        return ctx


POLLER = web.AppKey("poller", Poller)
CONFIG = web.AppKey("config", DashboardConfig)
STREAMS = web.AppKey("streams", list[int])  # [open event streams]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def read_only(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every method but GET/HEAD is refused before routing, on every path."""
    if request.method not in READ_METHODS:
        return web.json_response({"error": "read-only: GET and HEAD only"}, status=405,
                                 headers={"Allow": "GET, HEAD"})  # fmt: skip
    return await handler(request)


def _token_ok(request: web.Request, token: str) -> bool:
    given = request.cookies.get(COOKIE) or ""
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        given = auth.removeprefix("Bearer ")
    return hmac.compare_digest(given.encode(), token.encode())


def _host_name(host: str) -> str:
    """The name in a Host header, without the port: "[::1]:80" -> "[::1]"."""
    host = host.lower()
    if host.startswith("["):
        name, _, rest = host.partition("]")
        return name + "]" if rest == "" or (rest[:1] == ":" and rest[1:].isdigit()) else host
    return host.rsplit(":", 1)[0]


@web.middleware
async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The token (when configured) and, on loopback, a loopback Host header."""
    config = request.app[CONFIG]
    if is_loopback(config.host) and _host_name(request.host) not in LOOPBACK_NAMES:
        return web.json_response({"error": "Host must be loopback"}, status=421)
    token = config.token
    if token is not None:
        offered = request.query.get("token")
        if offered is not None and request.method == "GET":
            if not hmac.compare_digest(offered.encode(), token.encode()):
                return web.json_response({"error": "bad token"}, status=401)
            # Trade the URL token for a cookie, and drop it from the address bar/history.
            query = {k: v for k, v in request.query.items() if k != "token"}
            # One leading slash: "//host/..." would send the browser to another host.
            here = request.rel_url.with_path("/" + request.path.lstrip("/")).with_query(query)
            response = web.HTTPSeeOther(here)
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict",
                                secure=config.tls, path="/")  # fmt: skip
            return response
        if not _token_ok(request, token):
            return web.json_response({"error": "token required"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
    return await handler(request)


@web.middleware
async def headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        response = exc
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    response.headers.setdefault("Cache-Control", "no-store")
    if isinstance(response, web.HTTPException):
        raise response
    return response


async def page(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html")


async def fleet(request: web.Request) -> web.Response:
    return web.Response(body=request.app[POLLER].fleet, content_type="application/json")


async def service(request: web.Request) -> web.Response:
    body = request.app[POLLER].service_body(request.match_info["name"])
    if body is None:
        return web.json_response({"error": "no such service"}, status=404)
    return web.Response(body=body, content_type="application/json")


async def stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events: after every poll, the fleet (or one service's doc and sample)."""
    poller = request.app[POLLER]
    name = request.query.get("service")
    open_streams = request.app[STREAMS]
    if open_streams[0] >= MAX_STREAMS:
        return web.json_response({"error": "too many open streams"}, status=503,
                                 headers={"Retry-After": "5"})  # fmt: skip
    open_streams[0] += 1
    try:
        return await _stream(request, poller, name)
    finally:
        open_streams[0] -= 1


async def _stream(request: web.Request, poller: Poller, name: str | None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-store"})  # fmt: skip
    await response.prepare(request)
    try:
        await _relay(poller, name, response)
    except ConnectionResetError:
        pass  # the page went away
    return response


async def _relay(poller: Poller, name: str | None, response: web.StreamResponse) -> None:
    seq = poller.seq
    while True:
        seq_now = await poller.wait(seq, STREAM_KEEPALIVE)
        if seq_now == seq:
            await response.write(b": keep-alive\n\n")
            continue
        seq = seq_now
        if name is None:
            body = poller.fleet
        elif poller.error is not None:
            body = _ENCODER.encode({"error": poller.error})
        else:
            found = poller.latest.get(name)
            body = found if found is not None else b'{"gone": true}'
        await response.write(b"data: " + body + b"\n\n")


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(poller: Poller, config: DashboardConfig) -> web.Application:
    """The app (the poller is started and closed by whoever runs the app)."""
    app = web.Application(middlewares=[headers, read_only, access])
    app[POLLER] = poller
    app[CONFIG] = config
    app[STREAMS] = [0]
    app.router.add_get("/", page)
    app.router.add_get("/service/{name}", page)
    app.router.add_get("/api/fleet", fleet)
    app.router.add_get("/api/services/{name}", service)
    app.router.add_get("/api/stream", stream)
    app.router.add_get("/healthz", healthz)
    app.router.add_static("/static/", STATIC, show_index=False, follow_symlinks=False)
    return app
