"""The proxy process, wired in one place.

ProxyApp starts, in order: the ready set (with its pool factory), the source of
the ready set, the client listener, the admin listener, and the sweeper. It
closes in the order written down in docs/architecture.md ("Shutdown order") and
tested in tests/proxy/test_shutdown.py:

1. fail readiness (/readyz answers 503) and stop accepting connections;
2. close idle client connections; let in-flight exchanges finish, up to
   `shutdown_grace` (their responses carry `Connection: close`);
3. abort what is still running;
4. close the connection pools;
5. close the source (Redis, the Sky Serve sync client) and the admin listener.

Every step after the drain is bounded (CLOSE_BOUND seconds in all), whatever
state the replicas, Redis or the Sky Serve controller are in: a SIGTERM ends the
process within `shutdown_grace + CLOSE_BOUND`. Background tasks are stopped
with proxy.stopping.stop_tasks, since one cancel does not always stop a loop that
runs library code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time

from proxy import limits
from proxy.accesslog import AccessLog
from proxy.admin import AdminServer
from proxy.config import ProxyConfig
from proxy.errors import ConfigError
from proxy.pool import Clock, ReplicaPool
from proxy.readyset import ReadySet
from proxy.replica import Replica
from proxy.server import ClientConnection, ServerContext
from proxy.sources import Source, make_source
from proxy.sources import describe as describe_source
from proxy.stats import Stats
from proxy.stopping import bounded, stop_tasks

log = logging.getLogger("sluice.proxy")

TICK_SECONDS = 0.1
# Seconds the steps after the drain may take in all: pools 0.5, source 2.0, admin 1.0.
CLOSE_BOUND = 3.5


class ProxyApp:
    def __init__(self, config: ProxyConfig, source: Source | None = None) -> None:
        self.config = config
        self.stats = Stats()
        self.ready_set = ReadySet(
            policy_override=config.policy,
            target_qps=config.target_qps,
            prefix_options=config.prefix_options,
            pool_factory=self._make_pool,
            pool_grace=config.pool_grace,
            resume_streams=config.resume_streams,
        )
        self.source = source if source is not None else make_source(config, self.stats)
        self.ctx: ServerContext | None = None
        self.server: asyncio.Server | None = None
        self.admin: AdminServer | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._upstream_ssl = ssl.create_default_context()
        self.clock = Clock(time.monotonic())  # the pools' coarse clock (loop time from start)
        self.port = config.port

    def _make_pool(self, replica: Replica) -> ReplicaPool:
        return ReplicaPool(
            replica,
            limit=self.config.pool_size,
            connect_timeout=self.config.connect_timeout,
            clock=self.clock,
            idle_timeout=self.config.upstream_idle_timeout,
            ssl_context=self._upstream_ssl,
        )

    def _server_ssl(self) -> ssl.SSLContext | None:
        cfg = self.config
        if not cfg.tls_certfile and not cfg.tls_keyfile:
            return None
        if not (cfg.tls_certfile and cfg.tls_keyfile):
            raise ConfigError("--tls-certfile and --tls-keyfile go together")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            # Sky Serve passes paths like ~/.sky/serve/<service>/tls_keyfile.
            ctx.load_cert_chain(os.path.expanduser(cfg.tls_certfile),
                                os.path.expanduser(cfg.tls_keyfile))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load TLS certificate/key: {exc}") from exc
        return ctx

    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        server_ssl = self._server_ssl()
        ctx = ServerContext(cfg, self.ready_set, self.stats,
                            b"https" if server_ssl else b"http")
        self.ctx = ctx
        self.clock.now = ctx.now
        ctx.max_connections = limits.connection_cap(cfg.max_connections)
        if ctx.max_connections < cfg.max_connections:
            log.warning("--max-connections %d lowered to %d: the file-descriptor limit holds "
                        "two per connection", cfg.max_connections, ctx.max_connections)
        if cfg.access_log is not None:
            access_log = AccessLog(cfg.access_log)
            try:
                access_log.open()
            except OSError as exc:
                raise ConfigError(f"cannot open the access log {cfg.access_log}: {exc}") from exc
            ctx.access_log = access_log
        log.info("ready set from %s", describe_source(cfg))
        await self.source.start(self.ready_set)
        try:
            self.server = await loop.create_server(
                lambda: ClientConnection(ctx),
                cfg.host,
                cfg.port,
                ssl=server_ssl,
                reuse_port=cfg.workers > 1,
                backlog=4096,
            )
        except OSError as exc:
            await self.source.aclose()
            raise ConfigError(f"cannot listen on {cfg.host}:{cfg.port}: {exc}") from exc
        sock = self.server.sockets[0]
        self.port = sock.getsockname()[1]
        if cfg.admin_port is not None:
            self.admin = await self._start_admin(cfg.admin_port + cfg.worker_index)
        self._ticker = loop.create_task(self._tick_forever())
        log.info("sluice-proxy listening on %s:%d (%s, worker %d of %d), admin %s, "
                 "%d replicas", cfg.host, self.port, "https" if server_ssl else "http",
                 cfg.worker_index, cfg.workers, self.admin.url if self.admin else "off",
                 len(self.ready_set.replicas))

    async def _start_admin(self, port: int) -> AdminServer | None:
        cfg = self.config
        admin = AdminServer(self, cfg.admin_host, port)
        try:
            await admin.start()
            return admin
        except OSError as exc:
            await admin.aclose()
            if not cfg.controller_addr:
                raise ConfigError(f"cannot listen on admin port {port}: {exc}") from exc
            # Drop-in mode: Sky Serve runs one load balancer per service on the controller
            # host, all from the same command line; the second one must still start.
            log.warning("admin port %d is taken (%s); drop-in mode: trying a free port",
                        port, exc.strerror or exc)
        admin = AdminServer(self, cfg.admin_host, 0)
        try:
            await admin.start()
        except OSError as exc:
            await admin.aclose()
            log.warning("no admin listener (%s)", exc)
            return None
        return admin

    async def _tick_forever(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        while True:
            await asyncio.sleep(TICK_SECONDS)
            self.clock.now = ctx.loop.time()
            try:
                ctx.tick()
            except Exception:
                log.exception("sweeper tick failed")

    @property
    def ready(self) -> bool:
        ctx = self.ctx
        return ctx is not None and not ctx.draining and bool(self.ready_set.replicas)

    @property
    def draining(self) -> bool:
        """True once shutdown began (readiness failed, no new connections)."""
        return bool(self.ctx and self.ctx.draining)

    async def aclose(self) -> None:
        ctx = self.ctx
        if ctx is not None:
            ctx.draining = True
        if self.server is not None:
            self.server.close()
        if ctx is not None:
            for conn in list(ctx.connections):
                conn.close_if_idle()
            if ctx.connections:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ctx.drained.wait(), self.config.shutdown_grace)
            for conn in list(ctx.connections):
                if conn.transport is not None:
                    conn.transport.abort()
        await stop_tasks([self._ticker], 0.1)
        self._ticker = None
        if ctx is not None and ctx.access_log is not None:
            ctx.access_log.close()
            ctx.access_log = None
        if ctx is not None:
            await bounded(ctx.warmer.aclose(), 1.0, "stopping the warm-ups")
        pools = [r.pool for r in self.ready_set.known.values() if r.pool is not None]
        self.ready_set.close()
        waits = [pool.wait_closed() for pool in pools]
        if waits:
            await bounded(asyncio.gather(*waits), 0.5, "closing the connection pools")
        await bounded(self.source.aclose(), 2.0, "closing the ready-set source")
        if self.admin is not None:
            await bounded(self.admin.aclose(), 1.0, "closing the admin listener")
        if self.server is not None:
            await self.server.wait_closed()
