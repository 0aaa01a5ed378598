"""Hostile clients and bounded resources (issue 24, the proxy's items): one test per finding.

Real sluice-proxy processes (or a ProxyApp in the test's loop where the test must drive
the ready set) in front of a ScriptedUpstream, spoken to over raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import pytest

from proxy import parent
from proxy.metrics import render
from tests.support import rawhttp
from tests.support.harness import (
    BASE_ARGS,
    ManualSource,
    ScriptedUpstream,
    inprocess_proxy,
    metric,
    scrape,
)
from tests.support.poll import until
from tests.support.ports import HOST
from tests.support.processes import ProxyFactory
from tests.support.rawhttp import connect, get, read_head

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def read_all(conn: rawhttp.RawConnection, within: float = 10.0) -> bytes:
    """Everything the peer sends until it closes (a reset ends it too)."""
    out = b""
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(within):
            while chunk := await conn.reader.read(65536):
                out += chunk
    return out


# -- 3. Pipelining: parsed-but-unserved requests are bounded per connection --------------


async def test_pipeline_deeper_than_the_bound_is_not_parsed(proxy_factory: ProxyFactory) -> None:
    async with ScriptedUpstream({"/a": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])  # defaults
        async with connect(proxy.port) as conn:
            conn.send(get("/a") * 2000)  # one write: 2,000 requests, each ~40 bytes
            wire = await read_all(conn)
        # The one answered at once and the 16 (--max-pipeline's default) queued behind it;
        # the last says it closes. Before: all 2,000 parsed at once, and served.
        assert len(upstream.requests) == 17
        assert wire.count(b"HTTP/1.1 200") <= 17
        if wire.count(b"HTTP/1.1 200") == 17:
            assert wire.rsplit(b"HTTP/1.1 200", 1)[1].lower().count(b"connection: close") == 1
        samples = await scrape(proxy.admin_url)
        assert metric(samples, "sluice_pipeline_overflows_total") == 1


async def test_pipelining_within_the_bound_is_served_in_full(proxy_factory: ProxyFactory) -> None:
    async with ScriptedUpstream({"/a": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--max-pipeline", "4",
                                           replicas=[upstream.url])
        async with connect(proxy.port) as conn:
            conn.send(get("/a") * 5)
            for _ in range(5):
                assert (await conn.response()).status == 200
            assert (await conn.request(get("/a"))).status == 200  # still open
        assert len(upstream.requests) == 6


# -- 4. Connection cap, idle before the first byte, fd limit ------------------------------


async def test_connections_past_the_cap_are_closed_logged_once_and_counted(
    proxy_factory: ProxyFactory,
) -> None:
    async with ScriptedUpstream({"/a": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--max-connections", "3",
                                           replicas=[upstream.url])
        async with contextlib.AsyncExitStack() as stack:
            idle = [await stack.enter_async_context(connect(proxy.port)) for _ in range(3)]
            async with connect(proxy.port) as one, connect(proxy.port) as two:  # at once
                assert await one.closed_by_peer(within=10)
                assert await two.closed_by_peer(within=10)
            samples = await scrape(proxy.admin_url)
            assert metric(samples, "sluice_client_connections_refused_total") == 2
            assert proxy.output().count("connections at the cap") == 1
            idle[0].abort()  # one leaves: a new client is served again
            resp = await until(lambda: _try_get(proxy.port), what="a connection under the cap")
            assert resp.status == 200


async def test_at_the_cap_idle_connections_make_room_for_a_client(
    proxy_factory: ProxyFactory,
) -> None:
    async with ScriptedUpstream({"/a": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--max-connections", "3",
                                           replicas=[upstream.url])
        async with contextlib.AsyncExitStack() as stack:
            # An attacker holds every slot with silent connections and never lets go...
            silent = [await stack.enter_async_context(connect(proxy.port)) for _ in range(3)]
            # ...yet a client with a request gets in within seconds, not --header-timeout
            # (30 s): at the cap, idle connections close after 1 s.
            resp = await until(lambda: _try_get(proxy.port), what="a client served")
            assert resp.status == 200
            assert all([await c.closed_by_peer(within=10) for c in silent])


async def _try_get(port: int) -> rawhttp.Response | None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        return await rawhttp.fetch(port, get("/a"))
    return None


async def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
    proxy_factory: ProxyFactory,
) -> None:
    proxy = await proxy_factory.astart(*BASE_ARGS, "--header-timeout", "1",
                                       replicas=["http://127.0.0.1:9"])
    async with connect(proxy.port) as conn:
        # Before: the 75 s keep-alive timeout applied to a connection that never spoke.
        assert await conn.closed_by_peer(within=15)


async def test_the_soft_fd_limit_is_raised_to_the_hard_limit(proxy_factory: ProxyFactory) -> None:
    low = ("import resource, runpy, sys; soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE);"
           " resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard));"
           " sys.argv[0] = 'sluice-proxy'; runpy.run_module('proxy.cli', run_name='__main__')")
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=["http://127.0.0.1:9"],
                                       command=[sys.executable, "-c", low])
    with open(f"/proc/{proxy.pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    assert soft == hard


# -- 5. Held requests: bounded in count and bytes; a departed client is never served ----


async def test_held_requests_past_the_count_get_a_fast_503() -> None:
    source = ManualSource()
    async with inprocess_proxy(source, empty_wait=30.0, max_held=2) as app:
        source.publish()  # no replica: requests are held
        async with connect(app.port) as a, connect(app.port) as b:
            a.send(get("/x"))
            b.send(get("/x"))
            await until(lambda: app.stats.held == 2, what="two held requests")
            third = await rawhttp.fetch(app.port, get("/x"))
            assert third.status == 503
            assert third.header("Retry-After") == "1"
            assert app.stats.held_refused == 1
            assert app.stats.held == 2  # the first two are still held


async def test_held_body_bytes_past_the_bound_get_a_fast_503() -> None:
    source = ManualSource()
    body = b"x" * (300 * 1024)
    async with inprocess_proxy(source, empty_wait=30.0, max_held_bytes=400 * 1024) as app:
        source.publish()
        async with connect(app.port) as a:
            a.send(get("/x", method="POST", body=body))
            await until(lambda: app.stats.held_bytes >= 256 * 1024, what="a held body")
            async with connect(app.port) as b:
                b.send(get("/x", method="POST", body=body))
                resp = await b.response()
            assert resp.status == 503
            assert resp.header("Retry-After") == "1"
            assert app.stats.held_refused == 1
            assert app.stats.held == 1
        await until(lambda: app.stats.held == 0 and app.stats.held_bytes == 0,
                    what="the held request's accounting released")


async def test_a_held_request_whose_client_left_is_never_sent() -> None:
    source = ManualSource()
    body = b"y" * (600 * 1024)  # over the 256 KiB buffer: reading pauses, the FIN is unread
    async with ScriptedUpstream({"/x": OK, "/after": OK}) as upstream:
        async with inprocess_proxy(source, empty_wait=30.0) as app:
            source.publish()
            async with connect(app.port) as conn:
                conn.send(get("/x", method="POST", body=body))
                await until(lambda: app.stats.held_bytes >= 256 * 1024, what="a held body")
            # The client is gone with its body half read; the proxy notices without reading.
            await until(lambda: app.stats.held == 0, what="the departed client noticed")
            assert app.stats.departed_while_held == 1
            source.publish(upstream.url)
            after = await rawhttp.fetch(app.port, get("/after"))
            assert after.status == 200
    assert [r.url for r in upstream.requests] == ["/after"]


# -- 6. HEAD with --hold-heartbeat ---------------------------------------------------------


async def test_held_head_gets_no_heartbeat_body_and_does_not_hang() -> None:
    head_reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n"
    async with ScriptedUpstream({"/v1/chat/completions": head_reply, "/next": OK}) as upstream:
        source = ManualSource()
        async with inprocess_proxy(source, empty_wait=30.0, hold_heartbeat=0.2) as app:
            source.publish()
            async with connect(app.port) as conn:
                conn.send(get("/v1/chat/completions", method="HEAD", body=b'{"stream": true}'))
                await until(lambda: app.stats.held == 1, what="the HEAD held")
                t0 = app.ctx.now  # type: ignore[union-attr]
                # Past two heartbeat periods of the proxy's own clock: a heartbeat would be out.
                await until(lambda: app.ctx.now > t0 + 0.5,  # type: ignore[union-attr]
                            what="the sweeper past the heartbeat")
                source.publish(upstream.url)
                resp = await conn.response(head=True)
                assert resp.status == 200
                assert resp.header("Content-Type") == "application/json"
                assert resp.header("Transfer-Encoding") is None
                nxt = await conn.request(get("/next"))  # the connection is still in step
                assert (nxt.status, nxt.body) == (200, b"ok")


# -- 7. --workers: workers end with their supervisor ------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


async def test_workers_die_when_the_supervisor_is_killed(proxy_factory: ProxyFactory) -> None:
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=["http://127.0.0.1:9"], workers=2)
    workers = await until(lambda: len(proxy.worker_pids()) == 2 and proxy.worker_pids(),
                          what="two workers")
    proxy.kill(signal.SIGKILL)
    await until(lambda: not any(_alive(pid) for pid in workers), timeout=20,
                what="the orphaned workers to exit")


async def test_the_parent_watch_stops_a_worker_whose_parent_changed() -> None:
    stopped = asyncio.Event()
    await asyncio.wait_for(parent.watch_parent(os.getppid() + 1_000_000, stopped.set), 5)
    assert stopped.is_set()


# -- 10. Underscore spellings of the proxy's own headers ------------------------------


async def test_underscore_spellings_of_the_proxys_headers_are_dropped(
    proxy_factory: ProxyFactory,
) -> None:
    async with ScriptedUpstream({"/a": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        resp = await rawhttp.fetch(proxy.port, get(
            "/a", "X_Real_IP: 6.6.6.6", "X_Forwarded_For: 6.6.6.6", "x_forwarded_proto: https",
            "X_Forwarded_Host: evil.test", "X-Forwarded_Host: evil.test", "Content_Length: 9",
            "X_Custom: kept"))
        assert resp.status == 200
    (seen,) = upstream.requests
    assert {n for n in seen.names if "_" in n} == {"x_custom"}
    assert seen.all("X-Real-IP") == [HOST]
    assert seen.all("X-Forwarded-For") == [HOST]
    assert seen.all("X-Forwarded-Host") == ["proxy.test"]


# -- 11. HTTP details ------------------------------------------------------------------


async def test_no_100_continue_for_an_http10_client(proxy_factory: ProxyFactory) -> None:
    async with ScriptedUpstream({"/a": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with connect(proxy.port) as conn:
            conn.send(b"POST /a HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi")
            wire = await read_all(conn)
    assert wire.startswith(b"HTTP/1.1 200")
    assert b"100 Continue" not in wire


async def test_a_pipelined_expect_gets_its_100_when_its_turn_comes(
    proxy_factory: ProxyFactory,
) -> None:
    async with ScriptedUpstream({"/a": OK, "/b": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with connect(proxy.port) as conn:
            conn.send(get("/a") + b"POST /b HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                      b"Content-Length: 4\r\n\r\n")
            assert (await conn.response()).status == 200
            cont = await conn.response(skip_1xx=False)  # before: never came
            assert cont.status == 100
            conn.send(b"body")
            resp = await conn.response()
            assert resp.status == 200
    assert [(r.url, r.body) for r in upstream.requests] == [("/a", b""), ("/b", b"body")]


@pytest.mark.parametrize(("request_bytes", "status"), [
    (get("/a", "Expect: something-else"), 417),
    (b"GET /a HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    (b"GET /a\r\n\r\n", 400),  # an HTTP/0.9 request line
    (b"GET * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
])
async def test_requests_the_proxy_must_refuse_never_reach_a_replica(
    request_bytes: bytes, status: int, proxy_factory: ProxyFactory,
) -> None:
    async with ScriptedUpstream({"/a": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with connect(proxy.port) as conn:
            conn.send(request_bytes)
            got, _ = await read_head(conn.reader)
        assert got == status
        assert upstream.requests == []


async def test_options_asterisk_is_forwarded(proxy_factory: ProxyFactory) -> None:
    async with ScriptedUpstream({"*": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        resp = await rawhttp.fetch(proxy.port, b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n")
        assert resp.status == 200
    assert [(r.method, r.url) for r in upstream.requests] == [("OPTIONS", "*")]


async def test_an_h2c_upgrade_is_served_as_http11(proxy_factory: ProxyFactory) -> None:
    async with ScriptedUpstream({"/a": OK, "/b": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with connect(proxy.port) as conn:
            conn.send(get("/a", "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
                          "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA") + get("/b"))
            first = await conn.response(skip_1xx=False)
            assert (first.status, first.body) == (200, b"ok")  # not 101, not 501
            second = await conn.response()
            assert second.status == 200
    assert [r.url for r in upstream.requests] == ["/a", "/b"]
    assert not {"upgrade", "http2-settings"} & upstream.requests[0].names


async def test_a_websocket_upgrade_is_still_refused(proxy_factory: ProxyFactory) -> None:
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=["http://127.0.0.1:9"])
    resp = await rawhttp.fetch(proxy.port, get("/ws", "Connection: Upgrade",
                                               "Upgrade: websocket"))
    assert resp.status == 501


# -- 12. Bounded metric series; the admin port's token --------------------------------


async def test_prefix_counters_of_a_replica_gone_past_the_grace_are_dropped() -> None:
    source = ManualSource()
    gone, stays = "http://127.0.0.1:1", "http://127.0.0.1:2"
    async with inprocess_proxy(source, pool_grace=0.2, policy="prefix") as app:
        source.publish(gone, stays, policy="prefix")
        assert gone.encode() in render(app.ready_set, app.stats, worker=0)
        source.publish(stays, policy="prefix")
        await until(lambda: gone not in app.ready_set.known, what="the grace to pass")
        text = render(app.ready_set, app.stats, worker=0)
    assert gone.encode() not in text
    assert stays.encode() in text


async def test_admin_token_guards_metrics_and_snapshot_not_the_probes(
    proxy_factory: ProxyFactory,
) -> None:
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=["http://127.0.0.1:9"],
                                       env={"SLUICE_ADMIN_TOKEN": "s3cret"})
    assert "s3cret" not in " ".join(proxy.argv)
    for path in ("/metrics", "/snapshot"):
        assert proxy.admin_get(path)[0] == 401
    assert proxy.admin_get("/healthz")[0] == 200
    assert proxy.admin_get("/readyz")[0] == 200
    for path in ("/metrics", "/snapshot"):
        status = await asyncio.to_thread(_get_with_token, proxy.admin_port, path, "wrong")
        assert status == 401
        status = await asyncio.to_thread(_get_with_token, proxy.admin_port, path, "s3cret")
        assert status == 200


def _get_with_token(port: int, path: str, token: str) -> int:
    import http.client

    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        return conn.getresponse().status
    finally:
        conn.close()


async def test_metrics_can_be_served_without_the_snapshot(proxy_factory: ProxyFactory) -> None:
    proxy = await proxy_factory.astart(*BASE_ARGS, "--no-admin-snapshot",
                                       replicas=["http://127.0.0.1:9"])
    assert proxy.admin_get("/snapshot")[0] == 404
    status, body = proxy.admin_get("/metrics")
    assert status == 200
    assert b"sluice_held_requests" in body



@pytest.mark.parametrize("rdhup", [True, False], ids=["poll-rdhup", "msg-peek"])
async def test_departed_sees_a_fin_only_after_the_peer_closed(
    rdhup: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy import peer

    if not rdhup:
        monkeypatch.setattr(peer, "_RDHUP", None)  # the portable path

    class Conn(asyncio.Protocol):
        transport: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]
            self.transport.pause_reading()  # as a held request's connection is

    accepted: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

    async def on_client(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put(writer)

    loop = asyncio.get_running_loop()
    server = await asyncio.start_server(on_client, HOST, 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        _, conn = await loop.create_connection(Conn, HOST, port)
        remote = await accepted.get()
        assert peer.departed([conn]) == []  # open and silent
        if rdhup:  # poll(2) sees the FIN even behind unread data; MSG_PEEK cannot
            remote.write(b"x")
            await remote.drain()
            await until(lambda: peer.departed([conn]) == [], what="data is not a departure")
        remote.close()
        assert await until(lambda: peer.departed([conn]) == [conn], what="the peer gone")
        assert conn.transport is not None
        conn.transport.close()
