"""The proxy's log tells what it does without a line per request (proxy/failures.py):
a line each for the listener, the ready-set source, Redis connecting and each applied
snapshot; a 502/503/504 the proxy answered itself leaves one warning per kind per 10 s
and a count of the ones suppressed. Real replica, redis-server and sluice-proxy processes."""

from __future__ import annotations

import asyncio

from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store
from proxy.failures import FailureLog
from tests.support import rawhttp
from tests.support.harness import BASE_ARGS
from tests.support.poll import until
from tests.support.ports import HOST
from tests.support.processes import Proxy, ProxyFactory, ReplicaFactory


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


def failure_lines(proxy: Proxy) -> list[str]:
    return [line for line in proxy.stderr_text().splitlines() if "upstream failure:" in line]


async def test_a_502_is_logged_once_and_a_burst_as_one_line_and_a_count(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    (replica,) = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[replica])
    text = proxy.stderr_text()
    assert "ready set from --replicas (1 static)" in text
    assert "(http, worker 0 of 1)" in text
    # The replica resets the connection before answering: every attempt fails, 502.
    resp = await rawhttp.fetch(proxy.port, get("/reset?token=s3cret"))
    assert resp.status == 502
    (line,) = await until(lambda: failure_lines(proxy), what="the 502's log line")
    assert "WARNING" in line and f"replica={replica.url}" in line and "status=502" in line
    assert "GET /reset " in line and "s3cret" not in line and "cause=UpstreamResetError" in line

    async def one() -> int:
        return (await rawhttp.fetch(proxy.port, get("/reset"))).status

    statuses: list[int] = []
    for _ in range(10):  # 100 more, 10 at a time
        statuses += await asyncio.gather(*(one() for _ in range(10)))
    assert statuses == [502] * 100
    summary = await until(lambda: [s for s in failure_lines(proxy) if "suppressed" in s],
                          timeout=20, what="the suppressed count")  # fmt: skip
    lines = failure_lines(proxy)
    assert len(lines) == 2, lines  # the first one and the count: not 101 lines
    assert "100 more suppressed in 10s" in summary[0] and f"replica={replica.url}" in summary[0]
    # A success logs nothing.
    assert (await rawhttp.fetch(proxy.port, get("/fast"))).status == 200
    assert len(failure_lines(proxy)) == 2


async def test_no_ready_replica_is_a_503_logged_with_its_cause(
    proxy_factory: ProxyFactory, redis_url: str, redis_prefix: str,
    replica_factory: ReplicaFactory,
) -> None:
    (replica,) = await replica_factory.astart(1)
    async with Store.from_url(redis_url, prefix=redis_prefix) as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")  # fmt: skip
        first = await store.commit("svc", replica_updates=[
            ReplicaRecord(id=1, status=ReplicaStatus.READY, url=replica.url)])
        proxy = await proxy_factory.astart(
            "--host", HOST, "--redis", redis_url, "--redis-prefix", redis_prefix,
            "--service", "svc", "--empty-wait", "0.2", wait="ready")  # fmt: skip
        text = proxy.stderr_text()
        assert "ready set from redis" in text and "(service svc)" in text
        assert "redis source for svc: connected at generation" in text
        assert (f"service svc: applied generation {first.generation} (1 replicas, policy "
                in text)  # fmt: skip
        # The replica leaves the snapshot: the proxy logs the apply, then a 503.
        second = await store.commit("svc", replica_updates=[
            ReplicaRecord(id=1, status=ReplicaStatus.SHUTTING_DOWN, url=replica.url)])
        await until(lambda: f"applied generation {second.generation} (0 replicas"
                    in proxy.stderr_text(), what="the second apply logged")  # fmt: skip
        resp = await rawhttp.fetch(proxy.port, get("/fast"))
        assert resp.status == 503
        (line,) = await until(lambda: failure_lines(proxy), what="the 503's log line")
        assert "replica=- GET /fast status=503 cause=no_ready_replica" in line


def test_kinds_are_bounded_and_windows_end() -> None:
    """Ever-new causes cannot grow the memory: past max_kinds they share one kind."""
    failures = FailureLog("svc", interval=10.0, max_kinds=4)
    for n in range(50):
        failures.record(0.0, replica="http://r", status=502, cause=f"error {n}",
                        head_line=b"GET / HTTP/1.1", attempts=1)  # fmt: skip
    assert len(failures._windows) == 5  # 4 kinds and the shared one
    failures.flush(5.0)
    assert len(failures._windows) == 5  # still within their windows
    failures.flush(10.0)
    assert failures._windows == {}
