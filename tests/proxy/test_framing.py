"""Request-path safety, one regression test per finding of issue 11: nothing one client or
one replica sends may reach another client's exchange, and every message is framed once.

A real sluice-proxy process in front of a ScriptedUpstream (exact reply bytes, a record of
exactly what the replica parsed), spoken to over raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from proxy.upstream import UpstreamConnection
from tests.support import rawhttp
from tests.support.harness import (
    BASE_ARGS,
    HOLD,
    ManualSource,
    ScriptedUpstream,
    get_json,
    inprocess_proxy,
)
from tests.support.poll import until
from tests.support.ports import HOST, free_port
from tests.support.processes import Proxy, ProxyFactory
from tests.support.rawhttp import get

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def inflight(proxy: Proxy) -> int:
    status, body = await get_json(f"{proxy.admin_url}/snapshot")
    assert status == 200
    return sum(r["inflight"] for r in body["replicas"])


async def inflight_is(proxy: Proxy, n: int) -> bool:
    return await inflight(proxy) == n


# -- 1. Connection tokens never unframe a request body ----------------------------------


@pytest.mark.parametrize("framing", ["content-length", "transfer-encoding"])
async def test_connection_naming_a_framing_header_cannot_smuggle_a_request(
    framing: str, proxy_factory: ProxyFactory,
) -> None:
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    if framing == "content-length":
        body_headers = f"Content-Length: {len(smuggled)}\r\n".encode()
        wire = smuggled
    else:
        body_headers = b"Transfer-Encoding: chunked\r\n"
        wire = b"%x\r\n%s\r\n0\r\n\r\n" % (len(smuggled), smuggled)
    async with ScriptedUpstream({"/a": OK, "/smuggled": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--pool-size", "1",
                                           replicas=[upstream.url])
        async with rawhttp.connect(proxy.port) as conn:
            resp = await conn.request(
                b"POST /a HTTP/1.1\r\nHost: proxy.test\r\n"
                b"Connection: keep-alive, " + framing.encode() + b"\r\n"
                + body_headers + b"\r\n" + wire)
            assert (resp.status, resp.body) == (200, b"ok")
            again = await conn.request(get("/a"))  # both sides still in step
            assert again.status == 200
        assert [(r.method, r.url, r.body) for r in upstream.requests] == [
            ("POST", "/a", smuggled), ("GET", "/a", b"")]


# -- 2. Trailers stay with their message; bounded upstream heads -----------------------------


async def test_trailers_never_reach_the_next_clients_response(
    proxy_factory: ProxyFactory,
) -> None:
    trailered = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Leak\r\n\r\n"
                 b"5\r\nfirst\r\n0\r\nX-Leak: A\r\n\r\n")
    async with ScriptedUpstream({"/t": trailered, "/next": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--pool-size", "1",
                                           replicas=[upstream.url])
        first = await rawhttp.fetch(proxy.port, get("/t"))  # one client...
        assert (first.status, first.body) == (200, b"first")
        second = await rawhttp.fetch(proxy.port, get("/next"))  # ...then another
        assert (second.status, second.body) == (200, b"ok")
        assert "x-leak" not in first.names | second.names
        assert upstream.connections == 1  # the same pooled connection served both


@pytest.mark.parametrize("shape", ["many", "large"])
async def test_oversized_upstream_head_gets_502(shape: str, proxy_factory: ProxyFactory) -> None:
    if shape == "many":
        extra = b"".join(b"X-H%d: v\r\n" % i for i in range(400))
    else:
        extra = b"X-Big: " + b"v" * (300 * 1024) + b"\r\n"
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + extra + b"\r\nok"
    async with ScriptedUpstream({"/huge": reply}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        resp = await rawhttp.fetch(proxy.port, get("/huge"))
        assert resp.status == 502
        assert b"UpstreamHeadersTooLarge" in resp.body


# -- 3. A replica's extra response never reaches anybody -------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_extra_response_from_a_replica_never_reaches_a_waiting_client(
    method: str, proxy_factory: ProxyFactory,
) -> None:
    mine = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n" + (b"first!" if method == "GET"
                                                              else b"")
    injected = (b"HTTP/1.1 200 OK\r\nX-Injected: yes\r\nContent-Length: 21\r\n\r\n"
                b"injected-body-for-you")
    own = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nb!"
    async with ScriptedUpstream({"/held": HOLD, "/b": own}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--pool-size", "1",
                                           replicas=[upstream.url])
        async with rawhttp.connect(proxy.port) as a, rawhttp.connect(proxy.port) as b:
            a.send(get("/held", method=method))
            held = await upstream.held.get()
            b.send(get("/b"))
            # B waits for the pool's only connection, the one A's answer arrives on.
            await until(lambda: inflight_is(proxy, 2), what="B queued for the connection")
            held.answer(mine + injected)  # one write: the reply and an unrequested one
            resp_a = await a.response(head=method == "HEAD")
            assert resp_a.status == 200
            assert resp_a.body == (b"first!" if method == "GET" else b"")
            resp_b = await b.response()
            assert (resp_b.status, resp_b.body) == (200, b"b!")
            assert "x-injected" not in resp_b.names
            assert resp_b.all("Content-Length") == ["2"]
            again = await b.request(get("/b"))  # B's connection is still in step
            assert (again.status, again.body) == (200, b"b!")
        assert upstream.connections == 2  # the confused connection was closed, not reused


# -- 4. Responses stay framed whatever their Connection header names -------------------------


async def test_response_connection_naming_content_length_stays_framed(
    proxy_factory: ProxyFactory,
) -> None:
    reply = b"HTTP/1.1 200 OK\r\nConnection: content-length\r\nContent-Length: 5\r\n\r\nhello"
    async with ScriptedUpstream({"/u": reply, "/next": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with rawhttp.connect(proxy.port) as conn:
            resp = await conn.request(get("/u"))
            assert resp.framing in ("length", "chunked")
            assert (resp.status, resp.body) == (200, b"hello")
            after = await conn.request(get("/next"))  # keep-alive: the next one parses
            assert (after.status, after.body) == (200, b"ok")


# -- 5. Review items -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def small_window_connection(port: int) -> AsyncIterator[rawhttp.RawConnection]:
    """A client connection with a tiny receive buffer: it fills after a few KiB unread."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
    try:
        yield rawhttp.RawConnection(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def test_pipelined_request_respects_the_clients_backpressure() -> None:
    first = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (32 * 1024) + b"a" * 32 * 1024
    size = 64 * 1024 * 1024
    big = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"b" * size
    source = ManualSource()
    async with (ScriptedUpstream({"/first": first, "/big": big}) as upstream,
                inprocess_proxy(source) as app,
                small_window_connection(app.port) as conn):
        source.publish(upstream.url)
        assert app.ctx is not None
        ctx = app.ctx
        [client] = await until(lambda: list(ctx.connections), what="the proxy's side")
        # Small buffers on the proxy's side of this connection (no autotuning): the first
        # response's only write is the one that leaves the transport over its high-water
        # mark, and it ends that exchange; then the pipelined one starts.
        assert client.transport is not None
        client.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client.transport.set_write_buffer_limits(high=1024)
        conn.send(get("/first") + get("/big"))  # the client reads nothing
        await until(lambda: len(upstream.requests) == 2, what="both requests forwarded")
        deadline = asyncio.get_running_loop().time() + 1.0
        while asyncio.get_running_loop().time() < deadline:
            assert upstream.unsent > 0, "the proxy read the whole second response"
            await asyncio.sleep(0.05)
        assert client.write_paused


async def test_forwarding_headers_are_the_proxys(proxy_factory: ProxyFactory) -> None:
    async with ScriptedUpstream({"/f": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        resp = await rawhttp.fetch(proxy.port, get(
            "/f", "X-Forwarded-For: 203.0.113.7", "X-Real-IP: 198.51.100.1",
            "Forwarded: for=198.51.100.2", "X-Forwarded-For: 203.0.113.8, 203.0.113.9"))
        assert resp.status == 200
        [seen] = upstream.requests
        assert seen.all("X-Forwarded-For") == ["203.0.113.7, 203.0.113.8, 203.0.113.9, 127.0.0.1"]
        assert seen.all("X-Real-IP") == ["127.0.0.1"]  # the peer, never the client's word
        assert seen.all("Forwarded") == []


async def test_absolute_form_target_is_rewritten_to_origin_form(
    proxy_factory: ProxyFactory,
) -> None:
    async with ScriptedUpstream({"/x": OK, "/": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        async with rawhttp.connect(proxy.port) as conn:
            for target in (b"http://evil.example/x?q=1", b"HTTP://evil.example:81"):
                resp = await conn.request(b"GET " + target + b" HTTP/1.1\r\n"
                                          b"Host: proxy.test\r\n\r\n")
                assert resp.status == 200
        assert [r.url for r in upstream.requests] == ["/x?q=1", "/"]
        assert [r.all("Host") for r in upstream.requests] == [[f"{HOST}:{upstream.port}"]] * 2
        assert [r.all("X-Forwarded-Host") for r in upstream.requests] == [
            ["evil.example"], ["evil.example:81"]]
        resp = await rawhttp.fetch(proxy.port, b"GET ftp://evil/x HTTP/1.1\r\nHost: a\r\n\r\n")
        assert resp.status == 400
        assert len(upstream.requests) == 2


@pytest.mark.parametrize("request_bytes", [
    b"GET /h HTTP/1.1\r\n\r\n",
    b"GET /h HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET /h HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n",
    b"GET /h HTTP/1.1\r\nHost: a, evil.example\r\n\r\n",
    b"GET /h HTTP/1.1\r\nHost: a/b@c\r\n\r\n",
], ids=["missing", "twice", "twice-http10", "list", "not-a-host"])
async def test_a_request_without_exactly_one_valid_host_gets_400(
    request_bytes: bytes, proxy_factory: ProxyFactory,
) -> None:
    async with ScriptedUpstream({"/h": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[upstream.url])
        resp = await rawhttp.fetch(proxy.port, request_bytes)
        assert resp.status == 400
        assert b"Host" in resp.body
        ok = await rawhttp.fetch(proxy.port, b"GET /h HTTP/1.0\r\n\r\n")  # 1.0 may omit it
        assert ok.status == 200
        assert len(upstream.requests) == 1


async def test_many_small_body_chunks_of_one_read_go_upstream_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writes: list[bytes] = []
    send = UpstreamConnection.send

    def counting_send(self: UpstreamConnection, data: bytes) -> None:
        writes.append(data)
        send(self, data)

    monkeypatch.setattr(UpstreamConnection, "send", counting_send)
    source = ManualSource()
    async with ScriptedUpstream({"/up": OK}) as upstream, inprocess_proxy(source) as app:
        source.publish(upstream.url)
        async with rawhttp.connect(app.port) as conn:
            conn.send(b"POST /up HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
            await until(lambda: len(writes) == 1, what="the head sent upstream")
            conn.send(b"".join(b"1\r\n%c\r\n" % c for c in b"abcdefghij") + b"0\r\n\r\n")
            resp = await conn.response()
            assert (resp.status, resp.body) == (200, b"ok")
        assert upstream.requests[0].body == b"abcdefghij"
        assert len(writes) == 2, writes  # the head, then all ten chunks and the last one


async def test_slow_upload_outlives_the_retry_deadline(proxy_factory: ProxyFactory) -> None:
    async with ScriptedUpstream({"/up": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--retry-deadline", "1",
                                           "--stream-idle-timeout", "5",
                                           replicas=[upstream.url])
        body = b"0123456789"
        async with rawhttp.connect(proxy.port) as conn:
            conn.send(get("/up", f"Content-Length: {len(body)}", method="POST"))
            for i in range(len(body)):  # 10 bytes over ~3 s: a client that is still sending
                conn.send(body[i:i + 1])
                await conn.writer.drain()
                await asyncio.sleep(0.3)
            resp = await conn.response()
            assert (resp.status, resp.body) == (200, b"ok")
        assert upstream.requests[0].body == body


async def test_stalled_upload_is_cut_by_the_idle_timeout(proxy_factory: ProxyFactory) -> None:
    async with ScriptedUpstream({"/up": OK}) as upstream:
        proxy = await proxy_factory.astart(*BASE_ARGS, "--retry-deadline", "60",
                                           "--stream-idle-timeout", "1",
                                           replicas=[upstream.url])
        async with rawhttp.connect(proxy.port) as conn:
            conn.send(get("/up", "Content-Length: 10", method="POST") + b"01234")
            resp = await conn.response()  # the other 5 bytes never come
            assert resp.status == 408
            assert await conn.closed_by_peer(5.0)
        assert upstream.requests == []


async def test_the_proxys_own_answer_to_head_has_no_body(proxy_factory: ProxyFactory) -> None:
    dead = f"http://{HOST}:{free_port()}"  # nothing listens: every attempt fails, 502
    proxy = await proxy_factory.astart(*BASE_ARGS, "--max-attempts", "1", replicas=[dead])
    async with rawhttp.connect(proxy.port) as conn:
        head = await conn.request(get("/x", method="HEAD"), head=True)
        assert head.status == 502
        # Had a body followed the HEAD answer, this response would start inside it.
        after = await conn.request(get("/x"))
        assert after.status == 502
        assert b"bad_gateway" in after.body
