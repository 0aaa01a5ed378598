"""The admin listener (aiohttp, off the request path): /healthz, /readyz, /metrics, /snapshot.

It listens on its own port (127.0.0.1 by default), so proxied paths are never
shadowed. With a token (--admin-token, SLUICE_ADMIN_TOKEN), /metrics and /snapshot
need `Authorization: Bearer TOKEN` (compared in constant time); the probes
(/healthz, /readyz) stay open, as load balancers and kubelets probe without
credentials. --no-admin-snapshot serves /metrics without /snapshot (docs/security.md).

It reads the proxy through AppView, the few things it shows, so it does not depend
on the app that owns it (proxy/app.py's ProxyApp is one).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
from aiohttp import web

from proxy import metrics
from proxy.config import ProxyConfig
from proxy.readyset import ReadySet
from proxy.stats import Stats


class AppView(Protocol):
    """What the admin listener reads of a running proxy."""

    @property
    def config(self) -> ProxyConfig: ...

    @property
    def ready_set(self) -> ReadySet: ...

    @property
    def stats(self) -> Stats: ...

    @property
    def ready(self) -> bool:
        """Serving: started, not draining, with at least one ready replica."""

    @property
    def draining(self) -> bool:
        """Shutdown began."""


_OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # probes: no token asked


class AdminServer:
    def __init__(self, app: AppView, host: str, port: int) -> None:
        self._app = app
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.url = f"http://{host}:{port}"

    async def start(self) -> None:
        cfg = self._app.config
        web_app = web.Application(middlewares=[self._auth] if cfg.admin_token else [])
        web_app.router.add_get("/healthz", self._healthz)
        web_app.router.add_get("/readyz", self._readyz)
        web_app.router.add_get("/metrics", self._metrics)
        if cfg.admin_snapshot:
            web_app.router.add_get("/snapshot", self._snapshot)
        # aiohttp waits up to shutdown_timeout (60 s by default) for admin requests in
        # progress at shutdown; ours answer at once, so a short wait is plenty.
        self._runner = web.AppRunner(web_app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        # No SO_REUSEPORT: each worker has its own admin port, and a second load
        # balancer on the host must not share (and split the scrapes of) ours.
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        bound = self._runner.addresses[0]  # the real port when asked for port 0
        self.url = f"http://{self._host}:{bound[1]}"

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                    ) -> web.StreamResponse:
        if request.path in _OPEN_PATHS:
            return await handler(request)
        expected = b"Bearer " + (self._app.config.admin_token or "").encode()
        given = request.headers.get("Authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(given, expected):
            return web.json_response({"error": "unauthorized"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        app = self._app
        body = {
            "ready": app.ready,
            "replicas": len(app.ready_set.replicas),
            "generation": app.ready_set.generation,
            "draining": app.draining,
        }
        return web.json_response(body, status=200 if app.ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        app = self._app
        body = metrics.render(app.ready_set, app.stats, worker=app.config.worker_index)
        return web.Response(body=body,
                            content_type="text/plain", charset="utf-8")

    async def _snapshot(self, request: web.Request) -> web.Response:
        app = self._app
        snap = app.ready_set.snapshot
        body = {
            "snapshot": msgspec.to_builtins(snap) if snap is not None else None,
            "generation": app.ready_set.generation,
            # Unix time this process applied the snapshot in force (None: none yet).
            "applied_at": app.ready_set.applied_at if snap is not None else None,
            "policy": app.ready_set.policy.name,
            "replicas": [
                {"url": r.url, "id": r.id, "inflight": r.inflight,
                 "prefilling": r.prefilling, "prefill_bytes": r.prefill_bytes,
                 "ready": r.left_at is None,
                 "pool": r.pool.size if r.pool is not None else 0}
                for r in app.ready_set.known.values()
            ],
        }
        return web.json_response(body)
