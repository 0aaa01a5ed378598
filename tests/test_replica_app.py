"""The test replica and its fixtures behave as the proxy tests assume: they are our instruments."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import time

import aiohttp
import pytest

from tests.support.poll import until, until_sync
from tests.support.ports import free_port
from tests.support.processes import ProxyFactory, Replica, ReplicaFactory, http_get


def raw_exchange(replica: Replica, request: bytes) -> bytes:
    """Send raw bytes, read until the replica closes the connection."""
    with socket.create_connection(("127.0.0.1", replica.port), timeout=5) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


async def test_fast_echo_and_head(replica_factory: ReplicaFactory) -> None:
    [r] = await replica_factory.astart(ids=["r1"])
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{r.url}/fast") as resp:
            assert resp.status == 200
            assert resp.headers["X-Replica-Id"] == "r1"
            assert len(await resp.read()) == 100
        async with s.head(f"{r.url}/fast") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Length"] == "100"
        body = os.urandom(70_000)
        async with s.patch(
            f"{r.url}/echo/a/b?x=1&x=2&y",
            data=body,
            headers=[("X-Multi", "1"), ("X-Multi", "2")],  # type: ignore[arg-type]
        ) as resp:
            echo = await resp.json()
        assert echo["method"] == "PATCH"
        assert echo["path"] == "/echo/a/b"
        assert echo["query_string"] == "x=1&x=2&y"
        assert [v for k, v in echo["headers"] if k == "X-Multi"] == ["1", "2"]
        assert echo["body_length"] == len(body)
        assert echo["body_sha256"] == hashlib.sha256(body).hexdigest()
        async with s.put(f"{r.url}/echo/raw", data=body) as resp:
            assert await resp.read() == body


async def test_streams_arrive_as_sent(replica_factory: ReplicaFactory) -> None:
    [r] = await replica_factory.astart()
    async with aiohttp.ClientSession() as s:
        start = time.monotonic()
        async with s.get(f"{r.url}/sse?n=3&interval=0.3") as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["Transfer-Encoding"] == "chunked"
            first = await resp.content.readuntil(b"\n\n")
            first_at = time.monotonic() - start
            rest = await resp.read()
            last_at = time.monotonic() - start
        assert first.startswith(b'data: {"i": 0')
        assert rest.count(b"data: ") == 2
        assert first_at < 0.3 < 0.6 <= last_at
        async with s.get(f"{r.url}/chunked?n=4") as resp:
            assert resp.headers["Transfer-Encoding"] == "chunked"
            assert (await resp.text()).splitlines() == [f"chunk {i}" for i in range(4)]
        async with s.get(f"{r.url}/stream_then_die") as resp:
            assert resp.status == 200
            assert await resp.content.readany() == b"first chunk\n"
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()


async def test_failures_on_demand(replica_factory: ReplicaFactory) -> None:
    [r] = await replica_factory.astart()
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await s.get(f"{r.url}/reset")
        for code in (204, 418, 500, 503):
            async with s.get(f"{r.url}/status/{code}") as resp:
                assert resp.status == code
        start = time.monotonic()
        async with s.get(f"{r.url}/slow?delay=0.2") as resp:
            assert await resp.text() == "slow\n"
        assert time.monotonic() - start >= 0.2
        async with s.get(f"{r.url}/close") as resp:
            assert resp.headers["Connection"] == "close"
    head, _, body = raw_exchange(r, b"GET /nolength?n=5000 HTTP/1.1\r\nHost: x\r\n\r\n").partition(
        b"\r\n\r\n"
    )
    assert head.startswith(b"HTTP/1.1 200")
    assert b"content-length" not in head.lower() and b"transfer-encoding" not in head.lower()
    assert body == b"n" * 5000


async def test_stats_count_cancellations(replica_factory: ReplicaFactory) -> None:
    [r] = await replica_factory.astart()
    async with aiohttp.ClientSession() as s:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await s.get(f"{r.url}/hang")
    # The replica notices the disconnect on its own schedule: poll, bounded.
    stats = await until(lambda: (s := r.stats())["cancelled"] >= 1 and s, timeout=5,
                        what="the replica to count the cancelled request")  # fmt: skip
    assert stats["cancelled_by_path"] == {"/hang": 1}
    assert stats["by_path"]["/hang"] == 1
    assert stats["total"] == 1  # the fixture's /health polls are not traffic
    assert stats["in_flight"] == 0


async def test_upload_streams_large_body(replica_factory: ReplicaFactory) -> None:
    [r] = await replica_factory.astart()
    body = os.urandom(8 * 1024 * 1024)

    async def gen():  # type: ignore[no-untyped-def]
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    async with aiohttp.ClientSession() as s, s.post(f"{r.url}/upload", data=gen()) as resp:
        assert await resp.json() == {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}


def test_ready_delay_and_process_control(replica_factory: ReplicaFactory) -> None:
    [slow, other] = replica_factory(2, ready_delay=0.5, wait_ready=False)
    assert http_get("127.0.0.1", slow.port, "/health")[0] == 503
    until_sync(lambda: http_get("127.0.0.1", slow.port, "/health")[0] == 200, timeout=5,
               what="the slow replica to be ready")  # fmt: skip
    other.kill()  # SIGKILL, reaped on return
    assert not other.alive and other.returncode == -signal.SIGKILL
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", other.port), timeout=1).close()
    assert slow.stop() == 0  # SIGTERM: clean exit
    assert free_port() not in (slow.port, other.port)


async def test_proxy_factory_starts_and_reaps_every_worker(
    replica_factory: ReplicaFactory, proxy_factory: ProxyFactory
) -> None:
    reps = await replica_factory.astart(2, ids=["a", "b"])
    proxy = await proxy_factory.astart(replicas=reps, workers=2)
    assert len(proxy.admin_urls) == 2
    for i in range(2):
        assert http_get("127.0.0.1", proxy.admin_port + i, "/readyz")[0] == 200
    async with aiohttp.ClientSession() as s:
        seen = set()
        for _ in range(10):
            async with s.get(f"{proxy.url}/fast") as resp:
                assert resp.status == 200
                seen.add(resp.headers["X-Replica-Id"])
    assert seen == {"a", "b"}
    workers = proxy.worker_pids()
    assert proxy.stop() == 0, proxy.stderr_text()
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
