"""The proxy under failure and abuse: dead and resetting replicas, deadlines, an empty ready
set, clients that leave, stalled streams, oversized and ambiguous requests, slowloris, pool
grace, SIGTERM drain, TLS, the admin listener and multiple workers.

Real replica and proxy processes on loopback; the ready-set tests run a ProxyApp in the
test's loop with a source the test drives.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support import rawhttp
from tests.support.harness import (
    BASE_ARGS,
    HOLD,
    ManualSource,
    ScriptedUpstream,
    SeenRequest,
    get_json,
    inprocess_proxy,
    metric,
    replica_stats,
    scrape,
)
from tests.support.poll import until
from tests.support.ports import HOST, free_port
from tests.support.processes import Proxy, ProxyFactory, Replica, ReplicaFactory
from tests.support.rawhttp import get
from tests.support.tls import write_cert

SLACK = 1.5  # seconds on top of a configured timeout, for a busy 2-core machine


def dead_url() -> str:
    """A replica URL with nothing listening behind it."""
    return f"http://{HOST}:{free_port()}"


def error_of(resp: rawhttp.Response) -> dict[str, Any]:
    assert resp.header("Content-Type") == "application/json"
    body: dict[str, Any] = json.loads(resp.body)
    return body


def proxied(replica: Replica) -> int:
    """Requests the replica saw, besides the fixture's /health probes."""
    by_path = replica.stats()["by_path"]
    return sum(n for path, n in by_path.items() if path != "/health")


async def snapshot_inflight(admin_url: str, field: str = "inflight") -> dict[str, int]:
    """Per replica URL, its `inflight` (or another count) in the admin /snapshot."""
    status, body = await get_json(f"{admin_url}/snapshot")
    assert status == 200
    return {r["url"]: r[field] for r in body["replicas"]}


# -- replicas that die, reset or hang -------------------------------------------------------


async def test_replica_sigkilled_under_load_costs_no_client_errors(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    reps = await replica_factory.astart(3)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=reps)
    victim = reps[0]
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()

    async def client() -> None:
        # Raw keep-alive connections: aiohttp would quietly resend a GET whose connection
        # dropped, hiding exactly the failure this test looks for.
        async with rawhttp.connect(proxy.port) as conn:
            while not stop.is_set():
                try:
                    resp = await conn.request(get("/slow?delay=0.02"))
                except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                    outcomes[type(exc).__name__] += 1
                    return
                ok = resp.status == 200 and resp.body == b"slow\n"
                outcomes["ok" if ok else f"http {resp.status}"] += 1

    clients = [asyncio.create_task(client()) for _ in range(8)]
    try:
        await until(lambda: victim.alive and victim.stats()["total"] >= 20,
                    what="the victim serving its share")
        victim.kill()  # SIGKILL with requests in flight on it and more about to pick it
        killed_at = outcomes.total()
        await until(lambda: outcomes.total() >= killed_at + 200 or outcomes.keys() - {"ok"},
                    what="200 more requests after the kill")
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert set(outcomes) == {"ok"}, outcomes
    samples = await scrape(proxy.admin_url)
    assert metric(samples, "sluice_upstream_retries_total") > 0  # the kill was felt


async def test_connect_failure_is_retried_on_another_replica(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [good] = await replica_factory.astart(1, ids=["good"])
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[dead_url(), good])
    async with rawhttp.connect(proxy.port) as conn:
        for _ in range(10):
            resp = await conn.request(get("/fast"))
            assert (resp.status, resp.header("X-Replica-Id")) == (200, "good")
    samples = await scrape(proxy.admin_url)
    retries = metric(samples, "sluice_upstream_retries_total")
    assert retries >= 1  # least_load's rotating tie-break sent some to the dead one first
    assert metric(samples, "sluice_upstream_attempts_total") == 10 + retries


async def test_reset_before_headers_is_retried_on_a_different_replica(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    reps = await replica_factory.astart(2)
    proxy = await proxy_factory.astart(*BASE_ARGS, "--max-attempts", "3", replicas=reps)
    resp = await rawhttp.fetch(proxy.port, get("/reset"))
    # Every replica resets: 502, naming the error class and nothing else.
    assert resp.status == 502
    assert "UpstreamResetError" in error_of(resp)["detail"]
    seen = [(await replica_stats(r))["by_path"].get("/reset", 0) for r in reps]
    assert all(n >= 1 for n in seen), seen  # the retry went to the other replica
    assert sum(seen) <= 3 + 1  # max attempts, plus at most one free stale-connection retry


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def test_a_pooled_connection_idle_past_the_upstream_idle_timeout_is_not_reused(
    proxy_factory: ProxyFactory,
) -> None:
    # The replica closes a connection idle 0.5 s as a request arrives on it (a keep-alive
    # timeout firing in the same instant: uvicorn and llama-server use 5 s). Before the
    # timeout, the proxy wrote the request into that close: a loss before any response
    # byte, saved only by the one free stale-connection retry.
    async with ScriptedUpstream({"/a": OK}, idle_race=0.5) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--upstream-idle-timeout", "0.3",
                                           replicas=[upstream.url])
        async with rawhttp.connect(proxy.port) as conn:
            for _ in range(3):  # back to back: one pooled connection, reused
                assert (await conn.request(get("/a"))).status == 200
            assert upstream.connections == 1
            await asyncio.sleep(0.8)  # the pooled connection idles past both timeouts
            assert (await conn.request(get("/a"))).status == 200
        assert upstream.raced == 0  # no request was written into the replica's close
        assert upstream.connections == 2  # the idle one was retired, a new one opened
        samples = await scrape(proxy.admin_url)
        assert metric(samples, "sluice_upstream_retries_total") == 0


async def test_with_every_replica_tried_the_last_attempt_avoids_the_one_that_refused(
    proxy_factory: ProxyFactory,
) -> None:
    # One replica is dead (connection refused); the live one is busy (a stream in flight)
    # and loses each request's first attempt (a stale keep-alive connection, a reset).
    # With both tried, the third attempt used to go to the least loaded replica: the dead
    # one, idle for being dead. A 502 for a request the live replica then served.
    seen: set[str] = set()

    def first_attempt_lost(req: SeenRequest) -> bytes:
        if req.url in seen:
            return OK
        seen.add(req.url)
        return b""  # closed unanswered

    async with ScriptedUpstream({"/r": first_attempt_lost, "/busy": HOLD}) as live:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--max-attempts", "3",
                                           "--policy", "least_load",
                                           replicas=[dead_url(), live.url])
        async with rawhttp.connect(proxy.port) as busy:
            busy.send(get("/busy"))
            held = await asyncio.wait_for(live.held.get(), 10)  # in flight on the live one
            statuses: Counter[int] = Counter()
            for i in range(6):
                async with rawhttp.connect(proxy.port) as conn:
                    statuses[(await conn.request(get(f"/r?i={i}"))).status] += 1
            held.answer(OK)
            assert (await busy.response()).status == 200
        assert statuses == {200: 6}, statuses
        assert sum(r.url.startswith("/r") for r in live.requests) == 12  # lost, then served


async def test_stale_pooled_connection_gets_one_free_retry(proxy_factory: ProxyFactory) -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    served: list[int] = []

    def second_request_finds_it_closed(req: object) -> bytes:
        served.append(1)
        return b"" if len(served) == 2 else ok

    async with ScriptedUpstream({"/ok": second_request_finds_it_closed}) as upstream:
        # One attempt allowed: only the free stale-connection retry can save request two.
        proxy = await proxy_factory.astart(*BASE_ARGS, "--max-attempts", "1",
                                           replicas=[upstream.url])
        for _ in range(2):
            resp = await rawhttp.fetch(proxy.port, get("/ok"))
            assert (resp.status, resp.body) == (200, b"ok")
        assert len(upstream.requests) == 3
        assert upstream.connections == 2


async def test_retry_resends_a_held_body_but_never_a_partly_sent_one(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [good] = await replica_factory.astart(1, ids=["good"])
    async with ScriptedUpstream({"/echo": lambda req: b""}) as dropper:  # reads, then hangs up
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[dropper.url, good])
        small = os.urandom(100_000)
        for _ in range(4):  # the rotating tie-break sends some to the dropper first
            resp = await rawhttp.fetch(proxy.port, get("/echo", method="POST", body=small))
            assert resp.status == 200
            assert json.loads(resp.body)["body_sha256"] == hashlib.sha256(small).hexdigest()
        assert len(dropper.requests) >= 1
        # Past the retry body limit (1 MiB) the body is streamed, not held: no retry, 502.
        hits_before, large = len(dropper.requests), os.urandom(3 << 20)
        statuses = [(await rawhttp.fetch(proxy.port, get("/echo", method="POST", body=large)))
                    .status for _ in range(4)]
        assert statuses.count(502) == len(dropper.requests) - hits_before >= 1
        assert set(statuses) <= {200, 502}


async def test_only_replica_dead_gives_502_not_503(proxy_factory: ProxyFactory) -> None:
    proxy = await proxy_factory.astart(*BASE_ARGS, "--retry-deadline", "10",
                                       replicas=[dead_url()])
    started = time.monotonic()
    resp = await rawhttp.fetch(proxy.port, get("/fast"))
    # The set is not empty (so no hold, no 503): the attempts fail, fast.
    assert resp.status == 502
    assert time.monotonic() - started < 5
    body = error_of(resp)
    assert body["error"] == "bad_gateway"
    assert "ConnectionRefusedError" in body["detail"]


async def test_no_retry_after_the_first_response_byte(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    reps = await replica_factory.astart(2)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=reps)
    async with rawhttp.connect(proxy.port) as conn:
        conn.send(get("/stream_then_die"))
        status, _ = await rawhttp.read_head(conn.reader)
        assert status == 200
        received: list[bytes] = []
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError, ValueError)):
            async with asyncio.timeout(10):
                async for chunk in rawhttp.read_chunks(conn.reader):
                    received.append(chunk)
    assert received == [b"first chunk\n"]  # then a visible cut, no terminating chunk
    seen = [(await replica_stats(r))["by_path"].get("/stream_then_die", 0) for r in reps]
    assert sum(seen) == 1


async def test_deadline_gives_504_in_time_and_cancels_upstream(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, "--retry-deadline", "1", replicas=[rep])
    started = time.monotonic()
    resp = await rawhttp.fetch(proxy.port, get("/hang"))
    elapsed = time.monotonic() - started
    assert resp.status == 504
    assert error_of(resp)["error"] == "deadline_exceeded"
    assert 0.9 <= elapsed < 1 + SLACK
    stats = await until(lambda: (s := rep.stats())["cancelled_by_path"].get("/hang") and s,
                        what="the replica's /hang handler cancelled")
    assert stats["in_flight"] == 0


# -- an empty ready set (in process, the test drives the set) ------------------------------


async def test_empty_set_holds_then_503_with_retry_after() -> None:
    source = ManualSource()
    admin_port = free_port()
    async with inprocess_proxy(source, empty_wait=0.5, admin_port=admin_port) as app:
        status, ready = await get_json(f"http://{HOST}:{admin_port}/readyz")
        assert (status, ready["ready"], ready["replicas"]) == (503, False, 0)
        started = time.monotonic()
        resp = await rawhttp.fetch(app.port, get("/fast"))
        elapsed = time.monotonic() - started
    assert resp.status == 503
    assert int(resp.header("Retry-After") or "0") >= 1
    assert error_of(resp)["error"] == "no_ready_replica"
    assert 0.35 <= elapsed < 0.5 + SLACK  # held for the empty wait, then answered


async def test_empty_set_holds_until_a_replica_appears(
    replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1, ids=["late"])
    source = ManualSource()
    async with inprocess_proxy(source, empty_wait=20.0) as app:
        request = asyncio.create_task(rawhttp.fetch(app.port, get("/fast")))
        await until(lambda: app.stats.requests_total == 1, what="the request held")
        assert not request.done()
        source.publish(rep.url)
        async with asyncio.timeout(5):  # far less than the empty wait: woken, not timed out
            resp = await request
    assert (resp.status, resp.header("X-Replica-Id")) == (200, "late")


# -- clients that leave, and in-flight accounting ------------------------------------------


async def test_client_disconnect_cancels_upstream_and_counts_499(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[rep])
    async with rawhttp.connect(proxy.port) as conn:
        conn.send(get("/hang"))
        await until(lambda: rep.stats()["in_flight"] == 1, what="/hang in flight")
        assert (await snapshot_inflight(proxy.admin_url)) == {rep.url: 1}
        conn.abort()
    stats = await until(lambda: (s := rep.stats())["cancelled_by_path"].get("/hang") and s,
                        what="the replica's handler cancelled")
    assert stats["in_flight"] == 0

    async def counted() -> bool:
        samples = await scrape(proxy.admin_url)
        return (metric(samples, "sluice_responses_total", code="499") == 1
                and metric(samples, "sluice_client_disconnects_total") == 1)

    await until(counted, what="499 counted in /metrics")
    assert (await snapshot_inflight(proxy.admin_url)) == {rep.url: 0}


async def test_a_client_closing_after_the_done_event_counts_a_200_not_a_499(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    # Many SSE readers close once they read `data: [DONE]`; the replica's last chunk may
    # come after that. The client has its whole answer: not a client leaving.
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[rep])
    async with rawhttp.connect(proxy.port) as conn:
        conn.send(get("/sse?n=2&interval=0&done_then_hang=1"))
        await conn.writer.drain()
        status, _ = await rawhttp.read_head(conn.reader)
        assert status == 200
        events = b""
        async with asyncio.timeout(10):
            async for chunk in rawhttp.read_chunks(conn.reader):
                events += chunk
                if events.endswith(b"data: [DONE]\n\n"):
                    break
        assert events.count(b"data: ") == 3
        conn.abort()  # as the reader does at [DONE]
    await until(lambda: rep.stats()["cancelled_by_path"].get("/sse"),
                what="the replica's held last chunk cancelled")

    async def counted() -> bool:
        samples = await scrape(proxy.admin_url)
        return metric(samples, "sluice_responses_total", code="200") == 1

    await until(counted, what="the stream counted as a 200")
    samples = await scrape(proxy.admin_url)
    assert metric(samples, "sluice_client_disconnects_total") == 0
    assert (await snapshot_inflight(proxy.admin_url)) == {rep.url: 0}


@pytest.mark.parametrize("policy", ["least_load", "prefix"])
async def test_inflight_returns_to_zero_after_every_kind_of_abort(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory, policy: str,
) -> None:
    # With `prefix` every request carries a chat body of its own prompt: each is a
    # predicted cold prefill, counted on its replica until its first response byte, and
    # every way an exchange ends must give that count back too.
    reps = await replica_factory.astart(2)
    proxy = await proxy_factory.astart(*BASE_ARGS, "--retry-deadline", "3", "--policy", policy,
                                       replicas=reps)
    prompts = iter(range(100))

    def get(path: str) -> bytes:
        if policy == "least_load":
            return rawhttp.get(path)
        body = json.dumps({"messages": [{"role": "user", "content": f"{next(prompts)} " * 400}]})
        return rawhttp.get(path, "Content-Type: application/json", body=body.encode())

    async def abandon(path: str, after_head: bool) -> None:
        async with rawhttp.connect(proxy.port) as conn:
            conn.send(get(path))
            if after_head:
                await rawhttp.read_head(conn.reader)
                await conn.reader.readline()  # the first chunk's size line
            else:
                await until(lambda: sum(r.stats()["in_flight"] for r in reps) >= 1,
                            what=f"{path} in flight")
                if policy == "prefix":  # no response byte yet: still a cold prefill
                    cold = await snapshot_inflight(proxy.admin_url, "prefilling")
                    assert sum(cold.values()) >= 1, cold
                    cold = await snapshot_inflight(proxy.admin_url, "prefill_bytes")
                    assert sum(cold.values()) >= 800, cold  # its body: 800 bytes of prompt or more
            conn.abort()

    async def complete(path: str) -> int:
        try:
            return (await rawhttp.fetch(proxy.port, get(path))).status
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return -1  # /stream_then_die: cut mid-body

    await asyncio.gather(
        *(abandon("/hang", after_head=False) for _ in range(3)),
        *(abandon("/sse?n=100&interval=0.05", after_head=True) for _ in range(3)),
        *(complete(p) for p in ["/stream_then_die"] * 2 + ["/reset"] * 2
          + ["/status/500"] * 2 + ["/fast"] * 4),
    )

    async def all_zero() -> bool:
        inflight = await snapshot_inflight(proxy.admin_url)
        assert all(n >= 0 for n in inflight.values()), inflight  # never negative
        return set(inflight.values()) == {0}

    await until(all_zero, what="in-flight back to 0 on every replica")
    assert set((await snapshot_inflight(proxy.admin_url, "prefilling")).values()) == {0}
    assert set((await snapshot_inflight(proxy.admin_url, "prefill_bytes")).values()) == {0}
    samples = await scrape(proxy.admin_url)
    assert all(v == 0 for n, _, v in samples if n == "sluice_replica_inflight")
    resp = await rawhttp.fetch(proxy.port, get("/fast"))
    assert resp.status == 200


# -- streaming ---------------------------------------------------------------------------


async def test_first_sse_event_arrives_long_before_the_last_is_sent(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[rep])
    arrivals: list[tuple[float, dict[str, Any]]] = []
    async with rawhttp.connect(proxy.port) as conn:
        conn.send(get("/sse?n=5&interval=0.4"))
        status, headers = await rawhttp.read_head(conn.reader)
        assert status == 200
        assert dict(headers)["Content-Type"].startswith("text/event-stream")
        async with asyncio.timeout(10):
            async for chunk in rawhttp.read_chunks(conn.reader):
                now = time.time()
                for line in chunk.decode().splitlines():
                    if line.startswith("data: "):
                        arrivals.append((now, json.loads(line[6:])))
    assert [event["i"] for _, event in arrivals] == [0, 1, 2, 3, 4]
    first_received, first = arrivals[0]
    _, last = arrivals[-1]
    assert first_received < last["t"] - 1.0  # relayed as it came, not buffered to the end
    assert first_received - first["t"] < 1.0


async def test_stream_idle_timeout_cuts_a_stalled_stream(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, "--stream-idle-timeout", "1",
                                       replicas=[rep])
    async with rawhttp.connect(proxy.port) as conn:
        conn.send(get("/sse?n=3&interval=30"))
        status, _ = await rawhttp.read_head(conn.reader)
        assert status == 200
        chunks = rawhttp.read_chunks(conn.reader)
        first = await anext(chunks)
        assert first.startswith(b"data: ")
        stalled_at = time.monotonic()
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError, ValueError)):
            async with asyncio.timeout(1 + 2 * SLACK):
                await anext(chunks)
        elapsed = time.monotonic() - stalled_at
    assert 0.8 <= elapsed < 1 + 2 * SLACK  # cut visibly, long before the next event
    await until(lambda: rep.stats()["cancelled_by_path"].get("/sse") == 1,
                what="the stalled upstream stream cancelled")


async def test_slow_client_pauses_the_upstream(proxy_factory: ProxyFactory) -> None:
    size = 96 * 1024 * 1024  # far more than every socket buffer on the way can hold
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"b" * size
    async with ScriptedUpstream({"/big": reply}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with rawhttp.connect(proxy.port, limit=1 << 16) as conn:
            conn.send(get("/big"))
            status, _ = await rawhttp.read_head(conn.reader)
            assert status == 200
            # The client reads nothing more. Without backpressure across the proxy it would
            # drain the replica into its own memory within a moment.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                assert upstream.unsent > 0, "the proxy kept reading from the replica"
                await asyncio.sleep(0.05)
            received = 0  # and once the client reads again, the whole body arrives
            async with asyncio.timeout(60):
                while received < size:
                    data = await conn.reader.read(1 << 20)
                    assert data
                    received += len(data)
            assert received == size


# -- request bodies -------------------------------------------------------------------------


async def test_large_uploads_are_streamed_intact(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[rep])
    body = os.urandom(20 * 1024 * 1024)
    pieces = [os.urandom(1 << 20) for _ in range(6)]

    async def chunked() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(f"{proxy.url}/upload", data=io.BytesIO(body)) as resp:
            assert resp.status == 200
            assert await resp.json() == {"bytes": len(body),
                                         "sha256": hashlib.sha256(body).hexdigest()}
        async with s.post(f"{proxy.url}/upload", data=chunked()) as resp:  # chunked upload
            assert resp.status == 200
            whole = b"".join(pieces)
            assert await resp.json() == {"bytes": len(whole),
                                         "sha256": hashlib.sha256(whole).hexdigest()}


# -- what the raw request path must defend -------------------------------------------------


@dataclass
class Edge:
    proxy: Proxy
    replica: Replica


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    """One proxy with tight limits, shared by the tests of malformed and abusive requests
    (they only assert what reached the replica as a difference, so sharing is safe)."""
    replicas = ReplicaFactory(tmp_path_factory.mktemp("replicas"))
    proxies = ProxyFactory(tmp_path_factory.mktemp("proxy"))
    try:
        [rep] = replicas(1)
        proxy = proxies(*BASE_ARGS, "--max-body", "100000", "--header-timeout", "1",
                        replicas=[rep])
        yield Edge(proxy, rep)
    finally:
        proxies.close()
        replicas.close()


async def test_body_over_max_body_is_refused_with_413(edge: Edge) -> None:
    port, before = edge.proxy.port, proxied(edge.replica)
    async with rawhttp.connect(port) as conn:  # refused on the declared length alone
        conn.send(get("/upload", "Content-Length: 100001", method="POST"))
        resp = await conn.response()
        assert resp.status == 413
        assert error_of(resp)["error"] == "payload_too_large"
        assert await conn.closed_by_peer(within=5)
    assert proxied(edge.replica) == before
    async with rawhttp.connect(port) as conn:  # chunked: refused once it grows past
        conn.send(get("/upload", "Transfer-Encoding: chunked", method="POST"))
        for _ in range(2):
            conn.send(b"%x\r\n%s\r\n" % (60_000, b"z" * 60_000))
        resp = await conn.response()
        assert resp.status == 413
    resp = await rawhttp.fetch(port, get("/upload", method="POST", body=b"y" * 100000))
    assert resp.status == 200
    assert json.loads(resp.body)["bytes"] == 100000


@pytest.mark.parametrize("framing", [
    ["Content-Length: 5", "Transfer-Encoding: chunked"],
    ["Transfer-Encoding: chunked", "Content-Length: 5"],
    ["Content-Length: 5", "Content-Length: 5"],
    ["Content-Length: 5", "Content-Length: 6"],
    ["Content-Length: -5"],
    ["Content-Length: 5x"],
], ids=["cl-te", "te-cl", "cl-cl-same", "cl-cl-differ", "cl-negative", "cl-garbage"])
async def test_ambiguous_framing_is_refused_with_400(framing: list[str], edge: Edge) -> None:
    before = proxied(edge.replica)
    smuggled = get("/echo/smuggled")
    async with rawhttp.connect(edge.proxy.port) as conn:
        conn.send(get("/echo/front", *framing, method="POST") + b"0\r\n\r\n" + smuggled)
        resp = await conn.response()
        assert resp.status == 400
        assert await conn.closed_by_peer(within=5)
    assert proxied(edge.replica) == before  # neither request reached the replica


async def test_too_many_or_too_large_headers_are_refused_with_431(edge: Edge) -> None:
    port, before = edge.proxy.port, proxied(edge.replica)
    many = [f"X-H{i}: {i}" for i in range(150)]
    resp = await rawhttp.fetch(port, get("/echo", *many))
    assert resp.status == 431
    resp = await rawhttp.fetch(port, get("/echo", "X-Big: " + "a" * 80_000))
    assert resp.status == 431
    resp = await rawhttp.fetch(port, get("/echo?" + "q" * 80_000))
    assert resp.status == 431
    assert proxied(edge.replica) == before
    resp = await rawhttp.fetch(port, get("/echo", *many[:80], "X-Big: " + "a" * 8000))
    assert resp.status == 200  # ordinary big requests still pass


async def test_endless_header_line_is_refused_before_it_ends(edge: Edge) -> None:
    async with rawhttp.connect(edge.proxy.port) as conn:
        conn.send(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        status_line = b""
        for _ in range(40):  # up to 4 MB, never finishing the line
            conn.send(b"a" * 100_000)
            await conn.writer.drain()
            with contextlib.suppress(TimeoutError):
                status_line = await asyncio.wait_for(conn.reader.readline(), 0.05)
                break
    # A 431 answer (not the header timeout's silent abort): refused for its size.
    assert status_line.startswith(b"HTTP/1.1 431 "), \
        "the proxy kept buffering a header line past its header size limit"


async def test_websocket_upgrade_and_connect_are_refused_with_501(edge: Edge) -> None:
    port, before = edge.proxy.port, proxied(edge.replica)
    resp = await rawhttp.fetch(port, get(
        "/echo", "Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="))
    assert resp.status == 501
    assert error_of(resp)["error"] == "upgrade_not_supported"
    resp = await rawhttp.fetch(port, b"CONNECT example.com:443 HTTP/1.1\r\n"
                                     b"Host: example.com:443\r\n\r\n")
    assert resp.status == 501
    assert proxied(edge.replica) == before


async def test_slowloris_is_cut_after_the_header_timeout(edge: Edge) -> None:
    async with rawhttp.connect(edge.proxy.port) as conn:
        # Trickle a head one byte at a time: each byte is progress, but the head never ends.
        started = time.monotonic()
        head = b"GET /fast HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 1000
        closed = False
        for byte in head:
            conn.send(bytes([byte]))
            if await conn.closed_by_peer(within=0.2):
                closed = True
                break
            if time.monotonic() - started > 1 + 2 * SLACK:
                break
        assert closed
        assert 0.8 <= time.monotonic() - started < 1 + 2 * SLACK
    async with rawhttp.connect(edge.proxy.port) as conn:
        resp = await conn.request(get("/fast"))  # a kept-alive connection's next head too
        assert resp.status == 200
        conn.send(b"GET /fast HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        assert await conn.closed_by_peer(within=1 + 2 * SLACK)
        assert time.monotonic() - started >= 0.8


# -- pools, drain, TLS, admin, workers ---------------------------------------------------


async def test_departed_replica_keeps_its_warm_pool_for_the_grace() -> None:
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    source = ManualSource()
    async with ScriptedUpstream({"/ok": reply}) as upstream, \
            inprocess_proxy(source, pool_grace=30.0) as app:
        source.publish(upstream.url)
        assert (await rawhttp.fetch(app.port, get("/ok"))).status == 200
        replica = app.ready_set.known[upstream.url]
        pool = replica.pool
        assert pool is not None and pool.size == 1
        source.publish()  # the replica leaves the set
        assert app.ready_set.replicas == ()
        assert app.ctx is not None
        left = app.ctx.now
        await until(lambda: app.ctx.now > left + 0.5, what="several sweeps")
        assert app.ready_set.known.get(upstream.url) is replica
        assert pool.size == 1 and not pool.closed
        source.publish(upstream.url)  # it comes back: same pool, same connection
        assert app.ready_set.known[upstream.url].pool is pool
        assert (await rawhttp.fetch(app.port, get("/ok"))).status == 200
        assert upstream.connections == 1
        assert len(upstream.requests) == 2


async def test_departed_replica_pool_closes_after_grace_only_when_idle(
    replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    source = ManualSource()
    async with inprocess_proxy(source, pool_grace=0.2) as app:
        source.publish(rep.url)
        replica = app.ready_set.known[rep.url]
        pool = replica.pool
        assert pool is not None
        request = asyncio.create_task(rawhttp.fetch(app.port, get("/slow?delay=1.5")))
        await until(lambda: replica.inflight == 1, what="the slow request in flight")
        source.publish()
        assert app.ctx is not None
        left = app.ctx.now
        await until(lambda: app.ctx.now > left + 0.6, what="grace passed")
        assert not pool.closed  # a request is still in flight on it
        resp = await request
        assert (resp.status, resp.body) == (200, b"slow\n")
        await until(lambda: pool.closed and rep.url not in app.ready_set.known,
                    what="the pool closed after the grace")
        assert replica.inflight == 0


async def test_sigterm_drains_in_flight_and_refuses_new_connections(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, "--shutdown-grace", "20", replicas=[rep])
    async with aiohttp.ClientSession() as s:
        async def slow() -> tuple[int, bytes]:
            async with s.get(f"{proxy.url}/slow?delay=2") as resp:
                return resp.status, await resp.read()

        request = asyncio.create_task(slow())
        await until(lambda: rep.stats()["in_flight"] == 1, what="the slow request in flight")
        proxy.terminate()

        async def refused() -> bool:
            try:
                async with rawhttp.connect(proxy.port):
                    return False
            except ConnectionRefusedError:
                return True

        await until(refused, timeout=5, what="new connections refused")
        status, ready = await get_json(f"{proxy.admin_url}/readyz")
        assert (status, ready["draining"]) == (503, True)
        assert not request.done()
        assert await request == (200, b"slow\n")
    assert await asyncio.to_thread(proxy.wait, 10) == 0


async def test_tls_termination(
    tmp_path: Path, proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    ca, certfile, keyfile = write_cert(tmp_path)
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, "--tls-certfile", str(certfile),
                                       "--tls-keyfile", str(keyfile), replicas=[rep])
    assert proxy.url.startswith("https://")
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{proxy.url}/echo", data=b"over tls", ssl=client_ctx) as resp:
            assert resp.status == 200
            echo = await resp.json()
    assert echo["body_length"] == len(b"over tls")
    assert [v for k, v in echo["headers"] if k == "X-Forwarded-Proto"] == ["https"]
    async with rawhttp.connect(proxy.port) as conn:  # plaintext gets no HTTP answer
        conn.send(get("/fast"))
        with pytest.raises((ConnectionError, AssertionError, ValueError,
                            asyncio.IncompleteReadError)):
            await conn.response()


async def test_admin_endpoints(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1, ids=["only"])
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[rep])
    assert (await rawhttp.fetch(proxy.port, get("/fast"))).status == 200
    assert await get_json(f"{proxy.admin_url}/healthz") == (200, {"status": "ok"})
    status, ready = await get_json(f"{proxy.admin_url}/readyz")
    assert (status, ready["ready"], ready["replicas"]) == (200, True, 1)
    status, snap = await get_json(f"{proxy.admin_url}/snapshot")
    assert status == 200
    assert [r["url"] for r in snap["snapshot"]["replicas"]] == [rep.url]
    assert [(r["url"], r["inflight"], r["ready"], r["pool"]) for r in snap["replicas"]] == [
        (rep.url, 0, True, 1)]
    samples = await scrape(proxy.admin_url)
    names = {n for n, _, _ in samples}
    assert {
        "sluice_responses_total", "sluice_requests_total", "sluice_upstream_attempts_total",
        "sluice_upstream_retries_total", "sluice_client_disconnects_total",
        "sluice_replica_inflight", "sluice_pool_connections", "sluice_ready_replicas",
        "sluice_upstream_latency_seconds_bucket", "sluice_upstream_latency_seconds_count",
        "sluice_upstream_ttfb_seconds_bucket", "sluice_upstream_ttfb_seconds_count",
    } <= names
    assert metric(samples, "sluice_responses_total", code="200") == 1
    assert metric(samples, "sluice_requests_total") == 1
    assert metric(samples, "sluice_upstream_ttfb_seconds_count") == 1
    assert metric(samples, "sluice_upstream_latency_seconds_count") == 1
    assert metric(samples, "sluice_replica_inflight", replica=rep.url) == 0
    assert metric(samples, "sluice_pool_connections", replica=rep.url) == 1
    assert metric(samples, "sluice_ready_replicas") == 1
    # The admin paths live on their own port: on the proxy port they are the replica's.
    for path in ("/healthz", "/readyz", "/metrics", "/snapshot"):
        resp = await rawhttp.fetch(proxy.port, get(path))
        assert (resp.status, resp.header("X-Replica-Id")) == (404, "only")


async def test_two_workers_share_the_port_and_both_serve(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[rep], workers=2)
    admins = [proxy.admin_url, f"http://{HOST}:{proxy.admin_port + 1}"]

    async def worker_ready(url: str) -> bool:
        try:
            return (await get_json(f"{url}/readyz"))[0] == 200
        except aiohttp.ClientError:
            return False

    for url in admins:
        await until(lambda url=url: worker_ready(url), timeout=20, what=f"worker {url}")
    assert len(proxy.worker_pids()) == 2, proxy.output()
    for _ in range(40):  # new connections, spread by the kernel across both listeners
        resp = await rawhttp.fetch(proxy.port, get("/fast"))
        assert resp.status == 200
    served = [metric(await scrape(url), "sluice_requests_total") for url in admins]
    assert sum(served) == 40, (served, proxy.output())
    assert all(n > 0 for n in served), (served, proxy.output())
