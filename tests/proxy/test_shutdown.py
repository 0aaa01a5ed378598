"""SIGTERM ends a real sluice-proxy process within its shutdown grace plus a small bound,
whatever its connections, pools and ready-set source are doing at that moment.

Each test puts a proxy process into some awkward state (clients that never read, an
upstream that never answers, a request held for a replica, Redis stalled or gone, a Sky
Serve controller that accepts and never answers), sends SIGTERM and polls the process until
it has exited. The bound is generous (grace + 5 s) so a busy machine cannot flake it; a
hang shows as a process still alive after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable

import pytest

from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.redisserver import EmbeddedRedis
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store
from proxy.config import ProxyConfig
from proxy.readyset import ReadySet
from proxy.sources.redis import RedisSource
from proxy.stats import Stats
from tests.support import rawhttp
from tests.support.poll import until
from tests.support.ports import HOST
from tests.support.processes import Proxy, ProxyFactory, ReplicaFactory
from tests.support.rawhttp import get

GRACE = 1.0
BOUND = 5.0  # seconds on top of the grace a SIGTERMed proxy may take to exit
ARGS = ("--host", HOST, "--shutdown-grace", str(GRACE), "--empty-wait", "60",
        "--retry-deadline", "60")


async def exits_within(proxy: Proxy, seconds: float) -> float:
    """Wait until the process exits; fail (with its log) if it is alive after `seconds`.
    Returns how long it took."""
    started = time.monotonic()
    await proxy.exited(seconds)
    return time.monotonic() - started


async def sigterm_and_wait(proxy: Proxy) -> None:
    proxy.terminate()
    await exits_within(proxy, GRACE + BOUND)


@contextlib.asynccontextmanager
async def silent_server(
    held: list[asyncio.StreamWriter] | None = None,
) -> AsyncIterator[int]:
    """A TCP listener on 127.0.0.1 that accepts and reads but never answers; yields its port.
    Each accepted connection is appended to `held` (if given)."""
    if held is None:
        held = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass

    server = await asyncio.start_server(swallow, HOST, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in held:
            writer.transport.abort()
        await server.wait_closed()


def never_reading_client(port: int, request: bytes) -> socket.socket:
    """A blocking socket that sends `request` and then never reads (tiny receive buffer)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((HOST, port))
    sock.sendall(request)
    return sock


async def test_sigterm_with_every_kind_of_client_and_upstream_state(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*ARGS, "--stream-idle-timeout", "600", replicas=[rep])
    socks: list[socket.socket] = []
    async with contextlib.AsyncExitStack() as stack:
        # An idle keep-alive client.
        idle = await stack.enter_async_context(rawhttp.connect(proxy.port))
        assert (await idle.request(get("/fast"))).status == 200
        # A client in the middle of its request head.
        partial = await stack.enter_async_context(rawhttp.connect(proxy.port))
        partial.send(b"GET /fast HTTP/1.1\r\nHost: x\r\n")
        # A request the replica never answers.
        hung = await stack.enter_async_context(rawhttp.connect(proxy.port))
        hung.send(get("/hang"))
        # An endless stream, read by its client.
        stream = await stack.enter_async_context(rawhttp.connect(proxy.port))
        stream.send(get("/sse?n=100000&interval=0.05"))
        assert (await rawhttp.read_head(stream.reader))[0] == 200
        # A client that never reads a large response (the proxy's buffers fill up).
        big = b"x" * (16 << 20)
        socks.append(await asyncio.to_thread(
            never_reading_client, proxy.port,
            get("/echo/raw", "Content-Type: application/octet-stream", method="POST",
                body=big)))
        await until(lambda: rep.stats()["in_flight"] >= 1, what="the hung request")
        await sigterm_and_wait(proxy)
    for s in socks:
        s.close()


async def test_sigterm_with_a_request_held_for_a_replica(
    proxy_factory: ProxyFactory, redis_factory: Callable[..., EmbeddedRedis],
) -> None:
    server = redis_factory()
    async with Store.from_url(server.url, prefix="shut") as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")
    proxy = await proxy_factory.astart(*ARGS, "--redis", server.url, "--redis-prefix", "shut",
                                       "--service", "svc", wait="health")
    async with rawhttp.connect(proxy.port) as held:
        held.send(get("/fast"))
        await held.writer.drain()
        await until(lambda: b"sluice_requests_total 1.0" in proxy.admin_get("/metrics")[1],
                    what="the request held")
        await sigterm_and_wait(proxy)


@pytest.mark.parametrize("redis_state", ["stalled", "down"])
async def test_sigterm_while_redis_is_unreachable(
    redis_state: str, proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
    redis_factory: Callable[..., EmbeddedRedis],
) -> None:
    [rep] = await replica_factory.astart(1)
    server = redis_factory()
    async with Store.from_url(server.url, prefix="shut") as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")
        await store.commit("svc", replica_updates=[
            ReplicaRecord(id=1, status=ReplicaStatus.READY, url=rep.url)])
    proxy = await proxy_factory.astart(*ARGS, "--redis", server.url, "--redis-prefix", "shut",
                                       "--service", "svc", wait="ready")
    async with rawhttp.connect(proxy.port) as conn:
        assert (await conn.request(get("/fast"))).status == 200
        pid = server.pid
        assert pid is not None
        if redis_state == "stalled":
            os.kill(pid, signal.SIGSTOP)
            try:
                await sigterm_and_wait(proxy)
            finally:
                os.kill(pid, signal.SIGCONT)
        else:
            server.kill()
            await sigterm_and_wait(proxy)


async def test_sigterm_while_the_skyserve_controller_never_answers(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    syncs: list[asyncio.StreamWriter] = []
    async with silent_server(syncs) as port:
        # It serves once its first sync timed out (6 s); SIGTERM lands while the second
        # (a connection of its own) waits for an answer that never comes.
        proxy = await proxy_factory.astart(
            *ARGS, "--controller-addr", f"http://{HOST}:{port}", "--sync-interval", "0.2",
            "--sync-timeout", "6", wait="health", startup_timeout=60)
        async with rawhttp.connect(proxy.port) as held:
            held.send(get("/fast"))  # held: the set is empty
            await held.writer.drain()
            await until(lambda: len(syncs) >= 2, timeout=10, what="a second sync in flight")
            await sigterm_and_wait(proxy)


async def test_closing_the_redis_source_always_ends_its_tasks(
    redis_url: str, redis_prefix: str,
) -> None:
    """The root cause of the hung shutdowns: redis-py now and then swallows the cancellation
    of a command that is reading its reply (the pub/sub read, the rps flush pipeline); the
    loop carried on and aclose(), awaiting it after one cancel, never returned. Here the
    source is closed at many different moments while commits and flushes run flat out."""
    async with Store.from_url(redis_url, prefix=redis_prefix) as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")
        committing = True

        async def commit_forever() -> None:
            i = 0
            while committing:
                i += 1
                await store.commit("svc", replica_updates=[ReplicaRecord(
                    id=i % 3 + 1, status=ReplicaStatus.READY,
                    url=f"http://127.0.0.1:{20000 + i % 50}")])

        committer = asyncio.create_task(commit_forever())
        config = ProxyConfig(redis_url=redis_url, service="svc", redis_prefix=redis_prefix,
                             sync_interval=0.01)
        try:
            for i in range(60):
                source = RedisSource(config, Stats(), flush_interval=0.01)
                await source.start(ReadySet())
                await asyncio.sleep((i % 10) * 0.003)
                tasks = [source._sync_task, source._flush_task, source._demand_task]
                closing = asyncio.create_task(source.aclose())
                done, _ = await asyncio.wait({closing}, timeout=10)
                assert done, f"RedisSource.aclose() still running after 10 s (round {i})"
                assert all(t is not None and t.done() for t in tasks), (i, tasks)
        finally:
            committing = False
            await committer
