"""The request path: the client-side protocol and the Exchange that carries one request.

A ClientConnection parses requests with llhttp (httptools) and turns each into
an Exchange. The Exchange picks a replica from the ready set, takes a pooled
UpstreamConnection, writes the request head and body in one write, and relays
the response back chunk by chunk. The common path (a replica and an idle
connection available at once) runs entirely in protocol callbacks: no Task, no
Future, no logging, no timer object.

Timeouts are enforced by one sweeper per process (`ServerContext.tick`, every
100 ms) that looks at absolute deadlines and progress counters, instead of a
timer per request: the request deadline (until response headers; time spent
uploading the body to a replica does not count), the wait for a ready replica,
the idle time between response chunks and between request-body chunks (408),
the time to read a request head, and idle keep-alive connections.

Request-head rules (README, "Protocol hygiene"): exactly one Host (HTTP/1.0 may
omit it), absolute-form targets rewritten to origin-form, framing headers never
removed by a `Connection` token, X-Forwarded-For combined with the peer
appended, X-Real-IP set from the peer, a client's Forwarded dropped. Body bytes
parsed from one client read go upstream in one write (`flush_upstream`).

Retries: only before anything was sent to the client, only while the request
body is still held in full (bodies up to `retry_body_limit` are kept), up to
`max_attempts`, each on a replica not yet tried when one exists. A pooled
connection that turns out stale (closed before any response byte) gets one
extra attempt that does not count against `max_attempts`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from typing import TYPE_CHECKING

import httptools

from proxy import http
from proxy.config import ProxyConfig
from proxy.readyset import ReadySet, Replica
from proxy.stats import Stats

if TYPE_CHECKING:
    from proxy.pool import ReplicaPool
    from proxy.upstream import UpstreamConnection

log = logging.getLogger("sluice.proxy")

# Exchange states, in order.
NEW, WAIT_REPLICA, WAIT_CONN, SENT, STREAMING, DONE = range(6)

# Reasons the client connection's reading is paused (a bitmask).
PAUSE_PIPELINE, PAUSE_BODY_BUFFER, PAUSE_UPSTREAM = 1, 2, 4

_BODY_BUFFER_HIGH = 256 * 1024
# Bytes a Host value (uri-host [":" port], RFC 3986) may hold: deleting these must leave b"".
_HOST_BYTES = (b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
               b"-._~!$&'()*+;=:[]%")
_ROUTE_WAIT = 1.0  # longest a request waits for the body bytes its policy routes on
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')


def _origin_form(url: bytes) -> tuple[bytes, bytes]:
    """(origin-form target, authority) of an absolute-form target (RFC 9112 3.2.2)."""
    scheme, sep, rest = url.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        raise _Reject(http.BAD_TARGET, 400)
    cut = len(rest)
    for mark in (b"/", b"?", b"#"):
        at = rest.find(mark)
        if 0 <= at < cut:
            cut = at
    authority, path = rest[:cut], rest[cut:]
    if not authority or b"@" in authority:
        raise _Reject(http.BAD_TARGET, 400)
    path = path.partition(b"#")[0]
    if not path.startswith(b"/"):
        path = b"/" + path
    return path, authority


class _Reject(Exception):
    """Raised inside a parser callback to refuse a request with a ready response."""

    def __init__(self, response: bytes, status: int) -> None:
        self.response = response
        self.status = status


class ServerContext:
    """What every connection of one proxy process shares."""

    def __init__(self, config: ProxyConfig, ready_set: ReadySet, stats: Stats,
                 scheme: bytes) -> None:
        self.config = config
        self.ready_set = ready_set
        self.stats = stats
        self.scheme = scheme
        self.loop = asyncio.get_running_loop()
        self.now = self.loop.time()  # coarse clock, advanced by tick()
        self.connections: set[ClientConnection] = set()
        self.draining = False
        self.drained = asyncio.Event()  # set when draining and the last connection closed
        self.proto_header = b"X-Forwarded-Proto: " + scheme + b"\r\n"

    def tick(self) -> None:
        now = self.now = self.loop.time()
        for conn in list(self.connections):
            conn.tick(now)
        self.ready_set.sweep()


class ClientConnection(asyncio.Protocol):
    __slots__ = (
        "ctx",
        "current",
        "head_read",
        "head_started",
        "header_bytes",
        "headers",
        "http11",
        "idle_since",
        "parser",
        "pause_mask",
        "peer",
        "peer_tail",
        "pending",
        "reading",
        "transport",
        "upload",
        "url",
        "write_paused",
    )

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = b""
        self.peer_tail = ctx.proto_header
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.head_started = 0.0  # > 0 while a request head is being read
        self.head_read = 0  # bytes of later reads that left the head still unfinished
        self.http11 = True
        self.reading: Exchange | None = None  # request whose body is being read
        self.current: Exchange | None = None  # exchange answering the client now
        self.pending: deque[Exchange] = deque()  # pipelined requests waiting their turn
        self.pause_mask = 0
        self.write_paused = False  # the client's transport is over its high-water mark
        self.upload: Exchange | None = None  # request body bytes to send at the end of a read
        self.idle_since = ctx.now

    # -- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = str(peer[0]).encode("latin-1")
            # Headers the proxy sets from the connection itself, built once per connection.
            self.peer_tail = b"X-Real-IP: %s\r\n%s" % (self.peer, self.ctx.proto_header)
        self.ctx.connections.add(self)

    def data_received(self, data: bytes) -> None:
        continuing = self.head_started
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.reject(http.UPGRADE_REFUSED, 501)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self.reject(cause.response, cause.status)
            else:
                log.error("request path bug, connection dropped", exc_info=cause)
                if self.transport is not None:
                    self.transport.abort()
        except httptools.HttpParserError:
            self.reject(http.BAD_REQUEST, 400)
        else:
            upload = self.upload
            if upload is not None:
                self.upload = None
                upload.flush_upstream()
            if continuing and self.head_started:
                # llhttp reports a header only once its line ends: bound an endless one here.
                self.head_read += len(data)
                if self.head_read > self.ctx.config.max_header_bytes:
                    self.reject(http.HEADERS_TOO_LARGE, 431)

    def connection_lost(self, exc: Exception | None) -> None:
        ctx = self.ctx
        ctx.connections.discard(self)
        if ctx.draining and not ctx.connections:
            ctx.drained.set()
        current = self.current
        self.current = None
        if current is not None:
            current.on_client_lost()
        for ex in self.pending:
            ex.on_client_lost()
        self.pending.clear()
        reading = self.reading
        if reading is not None and reading is not current and reading.state != DONE:
            reading.on_client_lost()
        self.reading = None
        self.transport = None

    def pause_writing(self) -> None:
        # Kept as state, not only passed on: an exchange that starts later (the next
        # pipelined request) must begin paused, as no second pause_writing will come.
        self.write_paused = True
        ex = self.current
        if ex is not None and ex.upstream is not None:
            ex.upstream.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        ex = self.current
        if ex is not None and ex.upstream is not None:
            ex.upstream.resume_reading()

    # -- llhttp callbacks -----------------------------------------------------

    def on_message_begin(self) -> None:
        self.head_started = self.ctx.loop.time()
        self.head_read = 0
        self.url = b""
        self.headers = []
        self.header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.header_bytes += len(url)
        if self.header_bytes > self.ctx.config.max_header_bytes:
            raise _Reject(http.HEADERS_TOO_LARGE, 431)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        self.header_bytes += len(name) + len(value) + 4
        cfg = self.ctx.config
        if self.header_bytes > cfg.max_header_bytes or len(self.headers) > cfg.max_headers:
            raise _Reject(http.HEADERS_TOO_LARGE, 431)

    def on_headers_complete(self) -> None:
        parser = self.parser
        ctx = self.ctx
        if parser.should_upgrade():
            raise _Reject(http.UPGRADE_REFUSED, 501)
        started = self.head_started
        self.head_started = 0.0
        method: bytes = parser.get_method()
        http11 = self.http11 = parser.get_http_version() == "1.1"
        keep = []
        host = b""
        n_host = 0
        xff = b""
        chunked = b""  # the Transfer-Encoding values; re-chunked upstream as received
        expect = False
        n_length = 0
        length = 0
        connection: list[bytes] | None = None
        drop = http.REQUEST_DROP
        for name, value in self.headers:
            lname = name.lower()
            if lname in drop:
                if lname == b"host":
                    host = value
                    n_host += 1
                elif lname == b"transfer-encoding":
                    chunked = chunked + b", " + value if chunked else value
                elif lname == b"expect":
                    expect = value.lower() == b"100-continue"
                elif lname == b"connection":
                    if connection is None:
                        connection = [value]
                    else:
                        connection.append(value)
                continue
            if lname == b"content-length":
                n_length += 1
                try:
                    length = int(value)
                except ValueError:
                    raise _Reject(http.BAD_REQUEST, 400) from None
            elif lname == b"x-forwarded-for":
                xff += value + b", "  # every one, in order; the peer goes last
                continue
            keep.append(b"%s: %s\r\n" % (name, value))
        # Ambiguous framing is the root of request smuggling: refuse it outright.
        if n_length > 1 or (n_length and chunked):
            raise _Reject(http.BAD_REQUEST, 400)
        # RFC 9112 3.2: exactly one Host (HTTP/1.0 may omit it).
        if n_host > 1 or (not n_host and http11) or host.translate(None, _HOST_BYTES):
            raise _Reject(http.BAD_HOST, 400)
        if length > ctx.config.max_body:
            raise _Reject(http.TOO_LARGE, 413)
        url = self.url
        if url[:1] != b"/" and url != b"*":
            url, host = _origin_form(url)  # absolute-form: its authority replaces Host
        if connection is not None:
            named = http.named_hop_headers(connection)
            if named:
                keep = [
                    line for line in keep
                    if line.split(b":", 1)[0].lower() not in named
                ]
        keep.append(b"X-Forwarded-For: %s%s\r\n" % (xff, self.peer))
        keep.append(self.peer_tail)
        if host:
            keep.append(b"X-Forwarded-Host: %s\r\n" % host)
        if chunked:
            keep.append(b"Transfer-Encoding: %s\r\n" % chunked)
        keep.append(http.CRLF)
        ex = Exchange(
            self,
            method,
            method + b" " + url + b" HTTP/1.1\r\n",
            b"".join(keep),
            keep_alive=parser.should_keep_alive(),
            chunked=bool(chunked),
            started=started,
            has_body=length > 0 or bool(chunked),
        )
        ex.req_headers = self.headers
        self.reading = ex
        if self.current is None:
            self.current = ex
            if expect:
                self.transport.write(http.CONTINUE_100)  # type: ignore[union-attr]
            ex.start()
        else:
            self.pending.append(ex)
            self.pause_reading_for(PAUSE_PIPELINE)

    def on_body(self, body: bytes) -> None:
        ex = self.reading
        if ex is not None:
            ex.on_request_body(body)

    def on_message_complete(self) -> None:
        ex = self.reading
        self.reading = None
        if ex is not None:
            ex.on_request_complete()

    # -- used by exchanges and the sweeper ------------------------------------

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None:
            transport.write(data)

    def reject(self, response: bytes, status: int) -> None:
        """Answer a request the proxy refuses, then close (only if nothing else is being sent)."""
        self.ctx.stats.count_response(status)
        transport = self.transport
        if transport is None:
            return
        if self.current is None:
            transport.write(response)
            transport.close()
        else:
            transport.abort()

    def exchange_done(self, ex: Exchange, close: bool) -> None:
        if self.current is not ex:
            return
        self.current = None
        transport = self.transport
        if transport is None:
            return
        if close or self.ctx.draining:
            transport.close()
            return
        if self.pending:
            nxt = self.pending.popleft()
            self.current = nxt
            if not self.pending:
                self.resume_reading_for(PAUSE_PIPELINE)
            nxt.start()
        else:
            self.idle_since = self.ctx.now

    def pause_reading_for(self, reason: int) -> None:
        if self.pause_mask == 0 and self.transport is not None:
            self.transport.pause_reading()
        self.pause_mask |= reason

    def resume_reading_for(self, reason: int) -> None:
        if self.pause_mask & reason:
            self.pause_mask &= ~reason
            if self.pause_mask == 0 and self.transport is not None:
                self.transport.resume_reading()

    def close_if_idle(self) -> None:
        if self.current is None and self.reading is None and self.transport is not None:
            self.transport.close()

    def tick(self, now: float) -> None:
        ex = self.current
        if ex is not None:
            ex.tick(now)
            return
        transport = self.transport
        if transport is None:
            return
        cfg = self.ctx.config
        if self.head_started:
            if now - self.head_started > cfg.header_timeout:
                transport.abort()  # slowloris: the head never completed
        elif now - self.idle_since > cfg.keepalive_timeout:
            transport.close()


class Exchange:
    """One request from arrival to the end of its response."""

    __slots__ = (
        "attempts",
        "awaiting_body",
        "body",
        "body_done",
        "body_len",
        "body_whole",
        "chunked",
        "client",
        "close_after",
        "ctx",
        "deadline_at",
        "discard_body",
        "empty_until",
        "has_body",
        "head_line",
        "head_tail",
        "heartbeat_at",
        "is_head",
        "keep_alive",
        "last_error",
        "out",
        "pool",
        "progress",
        "progress_at",
        "replica",
        "req_headers",
        "resp_chunked",
        "route_key",
        "seen_progress",
        "sse_held",
        "stale_retry_used",
        "started",
        "state",
        "status",
        "tried",
        "up_out",
        "upload_at",
        "upstream",
    )

    def __init__(self, client: ClientConnection, method: bytes, head_line: bytes,
                 head_tail: bytes, *, keep_alive: bool, chunked: bool, started: float,
                 has_body: bool = False) -> None:
        ctx = client.ctx
        self.ctx = ctx
        self.client = client
        self.head_line = head_line
        self.head_tail = head_tail
        self.keep_alive = keep_alive
        self.chunked = chunked
        self.is_head = method == b"HEAD"
        self.started = started
        self.deadline_at = started + ctx.config.retry_deadline
        self.empty_until = 0.0
        self.heartbeat_at = 0.0
        self.sse_held = False  # our own 200 event-stream head went out while held
        self.discard_body = False
        self.state = NEW
        self.replica: Replica | None = None
        self.pool: ReplicaPool | None = None
        self.upstream: UpstreamConnection | None = None
        self.attempts = 0
        self.tried: set[Replica] | None = None
        self.stale_retry_used = False
        self.body: list[bytes] = []
        self.body_len = 0
        self.body_done = False
        self.body_whole = True  # every body byte received so far is still held
        self.out: list[bytes] = []
        self.up_out: list[bytes] = []  # request body bytes not yet written upstream
        self.upload_at = 0.0  # > 0 while the body streams to a replica: when that began
        self.resp_chunked = False
        self.close_after = not keep_alive
        self.status = 0
        self.progress = 0
        self.seen_progress = 0
        self.progress_at = 0.0
        self.last_error = "none"
        # Read by policies that route on the request (proxy/prefix.py).
        self.has_body = has_body
        self.awaiting_body = False  # holding the body's first bytes before choosing
        self.req_headers: list[tuple[bytes, bytes]] = []
        self.route_key: tuple[int, ...] | None = None

    # -- choosing a replica and a connection ------------------------------------

    def start(self) -> None:
        ctx = self.ctx
        ctx.stats.requests_total += 1
        if ctx.draining:
            self.close_after = True  # served, but the connection closes after it
        need = ctx.ready_set.policy.body_prefix
        if need and self.has_body and not self.body_done and self.body_len < need:
            # The policy routes on the body's first bytes: choose once they are here
            # (on_request_body, on_request_complete, or tick after _ROUTE_WAIT).
            self.awaiting_body = True
            return
        self.pick()

    def route_now(self) -> None:
        self.awaiting_body = False
        if self.state == NEW:  # not answered meanwhile (413, client gone)
            self.pick()

    def pick(self) -> None:
        ready_set = self.ctx.ready_set
        replica = ready_set.choose(self.tried, self)
        if replica is None:
            if ready_set.replicas:
                replica = ready_set.choose(None, self)  # every replica tried: reuse one
            if replica is None:
                self.state = WAIT_REPLICA
                cfg = self.ctx.config
                self.empty_until = min(self.ctx.now + cfg.empty_wait, self.deadline_at)
                if cfg.hold_heartbeat and not self.heartbeat_at:
                    self.heartbeat_at = self.ctx.now + cfg.hold_heartbeat
                ready_set.add_waiter(self.wake)
                return
        self.replica = replica
        replica.inflight += 1
        self.attempts += 1
        self.ctx.stats.attempts += 1
        pool: ReplicaPool = replica.pool  # type: ignore[assignment]
        self.pool = pool
        self.state = WAIT_CONN
        conn = pool.acquire(self)
        if conn is not None:
            self.on_connection(conn)

    def wake(self) -> None:
        if self.state == WAIT_REPLICA:
            self.pick()

    def wants_connection(self, pool: ReplicaPool) -> bool:
        return self.state == WAIT_CONN and self.pool is pool

    def on_connection(self, conn: UpstreamConnection) -> None:
        self.upstream = conn
        conn.exchange = self
        conn.in_response = False
        conn.body_framed = True
        self.state = SENT
        replica: Replica = self.replica  # type: ignore[assignment]
        head_line = self.head_line
        if replica.path:  # "GET /v1/x HTTP/1.1" -> "GET /prefix/v1/x HTTP/1.1"
            head_line = head_line.replace(b" ", b" " + replica.path, 1)
        parts = [head_line, b"Host: ", replica.host_header, http.CRLF, self.head_tail]
        if self.chunked:
            parts.extend(http.chunk(b) for b in self.body if b)
            if self.body_done:
                parts.append(http.LAST_CHUNK)
        else:
            parts.extend(self.body)
        if self.client.write_paused:
            conn.pause_reading()  # the client is not taking what it was already sent
        elif conn.paused:
            conn.resume_reading()  # paused by a previous exchange's slow client
        conn.send(b"".join(parts))
        if not self.body_done:
            self.upload_at = self.progress_at = self.ctx.now
        if self.body_len > self.ctx.config.retry_body_limit:
            self.body_whole = False
            self.body.clear()
        self.client.resume_reading_for(PAUSE_BODY_BUFFER)

    def on_connect_failed(self, error: Exception) -> None:
        self.last_error = str(error) or type(error).__name__
        self.release_replica()
        self.retry_or_fail(free=False)

    # -- the request body -----------------------------------------------------------

    def on_request_body(self, data: bytes) -> None:
        if self.state == DONE:
            return  # the replica answered early; the rest of the body is discarded
        self.body_len += len(data)
        cfg = self.ctx.config
        if self.body_len > cfg.max_body:
            if self.state < STREAMING:
                self.respond(http.TOO_LARGE, 413, close=True)
            else:
                self.cut()
            return
        self.progress += 1
        conn = self.upstream
        if conn is not None:
            # Sent once at the end of the client's read (many small chunks: one write).
            up_out = self.up_out
            if self.chunked:
                up_out.append(b"%x\r\n" % len(data))
                up_out.append(data)
                up_out.append(http.CRLF)
            else:
                up_out.append(data)
            self.upload_at_read_end()
            if self.body_whole:
                if self.body_len <= cfg.retry_body_limit:
                    self.body.append(data)
                else:
                    # Too large to keep for a retry: this request can no longer be retried.
                    self.body_whole = False
                    self.body.clear()
        else:
            # Not sent anywhere yet: hold it all (reading pauses past the high-water mark).
            self.body.append(data)
            if self.body_len > _BODY_BUFFER_HIGH:
                self.client.pause_reading_for(PAUSE_BODY_BUFFER)
            if self.awaiting_body and self.body_len >= self.ctx.ready_set.policy.body_prefix:
                self.route_now()

    def on_request_complete(self) -> None:
        self.body_done = True
        if self.awaiting_body:
            self.route_now()  # sends the whole body, with the last chunk, once connected
            return
        conn = self.upstream
        if conn is not None:
            if self.chunked:
                self.up_out.append(http.LAST_CHUNK)
                self.upload_at_read_end()
            if self.upload_at:
                # The time the client spent sending the body to the replica does not count
                # against the deadline (which bounds waiting for a replica and for headers).
                self.deadline_at += self.ctx.now - self.upload_at
                self.upload_at = 0.0

    def upload_at_read_end(self) -> None:
        """Have `up_out` written when the client's read has been parsed (one write per read)."""
        client = self.client
        waiting = client.upload
        if waiting is not self:
            if waiting is not None:
                waiting.flush_upstream()  # another exchange's bytes go first, as received
            client.upload = self

    def flush_upstream(self) -> None:
        up_out = self.up_out
        conn = self.upstream
        if up_out:
            if conn is not None:
                conn.send(up_out[0] if len(up_out) == 1 else b"".join(up_out))
            up_out.clear()

    # -- the response ---------------------------------------------------------------

    def on_response_headers(self, conn: UpstreamConnection, status: int,
                            headers: list[tuple[bytes, bytes]]) -> bool:
        """Relay the response head; True when no body follows (a HEAD request)."""
        ctx = self.ctx
        if (status >= 500 and self.replica is not None
                and self.replica.left_at is not None and self.can_retry()):
            # A replica that is leaving the set answers 5xx: try another one instead.
            self.last_error = f"HTTP {status} from a leaving replica"
            self.detach_upstream(abort=True)
            self.release_replica()
            self.retry_or_fail(free=False)
            return False
        self.state = STREAMING
        self.status = status
        ctx.stats.ttfb.observe(ctx.loop.time() - self.started)
        if self.sse_held:
            return self._continue_held_stream(conn, status, headers)
        out = [http.status_line(status)]
        hop = http.HOP_BY_HOP
        length = False
        chunked = False
        connection: list[bytes] | None = None
        for name, value in headers:
            lname = name.lower()
            if lname in hop:
                if lname == b"transfer-encoding":
                    chunked = True
                elif lname == b"connection":
                    if connection is None:
                        connection = [value]
                    else:
                        connection.append(value)
                continue
            if lname == b"content-length":
                length = True
            out.append(b"%s: %s\r\n" % (name, value))
        if connection is not None:
            named = http.named_hop_headers(connection)
            if named:
                out = [out[0]] + [
                    line for line in out[1:] if line.split(b":", 1)[0].lower() not in named
                ]
        no_body = self.is_head or status == 204 or status == 304
        if not no_body and not length:
            if not chunked:
                conn.body_framed = False  # ends when the replica closes
            if self.client.http11:
                out.append(b"Transfer-Encoding: chunked\r\n")
                self.resp_chunked = True
            else:
                self.close_after = True  # HTTP/1.0 client: delimit by closing
        elif self.is_head and chunked:
            out.append(b"Transfer-Encoding: chunked\r\n")
        if self.close_after or ctx.draining:
            self.close_after = True
            out.append(b"Connection: close\r\n")
        elif not self.client.http11:
            out.append(b"Connection: keep-alive\r\n")
        out.append(http.CRLF)
        self.out.append(b"".join(out))
        self.progress_at = ctx.now
        return self.is_head

    def _continue_held_stream(self, conn: UpstreamConnection, status: int,
                              headers: list[tuple[bytes, bytes]]) -> bool:
        """The client already has our 200 event-stream head: relay only the body."""
        if status != 200:
            self.out.append(http.chunk(http.sse_error(status, "upstream_status")))
            self.close_after = True
            self.discard_body = True
        names = {name.lower() for name, _ in headers}
        if b"content-length" not in names and b"transfer-encoding" not in names:
            conn.body_framed = False
        self.progress_at = self.ctx.now
        return False

    def heartbeat(self, now: float) -> None:
        """Held past --hold-heartbeat: start (or continue) the SSE heartbeat stream."""
        every = self.ctx.config.hold_heartbeat
        self.heartbeat_at = now + every
        if self.sse_held:
            self.client.write(http.chunk(http.SSE_HEARTBEAT))
            return
        # Only a complete `"stream": true` body from an HTTP/1.1 client (rare path: the
        # body was held in full, and this runs once per held request).
        if not (self.body_done and self.body_whole and self.client.http11
                and _STREAM_TRUE.search(b"".join(self.body))):
            self.heartbeat_at = float("inf")
            return
        self.sse_held = True
        self.resp_chunked = True
        self.client.write(http.SSE_HOLD_HEAD + http.chunk(http.SSE_HEARTBEAT))

    def on_response_body(self, data: bytes) -> None:
        self.progress += 1
        if self.discard_body:
            return
        if self.resp_chunked:
            self.out.append(b"%x\r\n" % len(data))
            self.out.append(data)
            self.out.append(http.CRLF)
        else:
            self.out.append(data)

    def flush_client(self) -> None:
        out = self.out
        if out:
            self.client.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def on_response_complete(self, conn: UpstreamConnection, reusable: bool) -> None:
        if self.resp_chunked:
            self.out.append(http.LAST_CHUNK)
        self.flush_client()
        conn.served += 1
        self.upstream = None
        pool: ReplicaPool = self.pool  # type: ignore[assignment]
        # A request body not fully sent leaves the connection mid-message: not reusable.
        pool.release(conn, reusable and self.body_done)
        stats = self.ctx.stats
        stats.upstream_latency.observe(self.ctx.loop.time() - self.started)
        stats.count_response(self.status)
        self.finish(self.close_after)

    def on_upstream_error(self, error: str) -> None:
        """The replica broke a limit (oversized headers or trailers): 502, or cut if started."""
        if self.state == STREAMING:
            self.cut()
        else:
            self.last_error = error
            self.respond(http.bad_gateway(error), 502)

    def on_upstream_lost(self, conn: UpstreamConnection, in_response: bool) -> None:
        self.upstream = None
        if self.state == STREAMING or in_response:
            # Cut after the first byte: never retried; end the client's stream visibly.
            self.flush_client()
            self.ctx.stats.count_response(self.status)
            self.finish(True)
            return
        self.last_error = "UpstreamResetError"
        free = conn.served > 0 and not self.stale_retry_used
        self.release_replica(tried=not free)
        self.retry_or_fail(free=free)

    # -- endings ----------------------------------------------------------------

    def can_retry(self) -> bool:
        return (self.body_whole and self.ctx.loop.time() < self.deadline_at
                and self.attempts < self.ctx.config.max_attempts)

    def retry_or_fail(self, free: bool) -> None:
        if self.state == DONE:
            return
        if free:
            self.stale_retry_used = True
            self.attempts -= 1
        if self.can_retry():
            self.ctx.stats.retries += 1
            self.pick()
        elif self.ctx.loop.time() >= self.deadline_at:
            self.respond(http.DEADLINE, 504)
        else:
            self.respond(http.bad_gateway(self.last_error), 502)

    def release_replica(self, tried: bool = True) -> None:
        replica = self.replica
        if replica is not None:
            self.replica = None
            replica.inflight -= 1
            if tried:
                if self.tried is None:
                    self.tried = {replica}
                else:
                    self.tried.add(replica)

    def detach_upstream(self, abort: bool) -> None:
        conn = self.upstream
        if conn is not None:
            self.upstream = None
            conn.exchange = None
            if abort:
                conn.abort()
        if self.state == WAIT_CONN and self.pool is not None:
            self.pool.cancel(self)
        elif self.state == WAIT_REPLICA:
            self.ctx.ready_set.remove_waiter(self.wake)

    def respond(self, response: bytes, status: int, close: bool = False) -> None:
        """Answer with a proxy-generated response; only before any response byte was sent."""
        self.detach_upstream(abort=True)
        self.release_replica()
        if self.sse_held:
            # Our 200 head is out: end the event stream with an error event instead.
            response = http.chunk(http.sse_error(status)) + http.LAST_CHUNK
        elif self.is_head:
            response = response[:response.index(b"\r\n\r\n") + 4]  # no body, ever, for HEAD
        self.client.write(response)
        self.ctx.stats.count_response(status)
        self.finish(close or self.close_after)

    def cut(self) -> None:
        """End a response that already started: the client sees the connection close."""
        self.detach_upstream(abort=True)
        self.flush_client()
        self.ctx.stats.count_response(self.status)
        self.finish(True)

    def finish(self, close: bool) -> None:
        if self.state == DONE:
            return
        self.state = DONE
        self.release_replica(tried=False)
        self.client.resume_reading_for(PAUSE_BODY_BUFFER | PAUSE_UPSTREAM)
        self.client.exchange_done(self, close)

    def on_client_lost(self) -> None:
        """The client went away: cancel the upstream request at once (499)."""
        if self.state == DONE:
            return
        self.detach_upstream(abort=True)
        self.release_replica(tried=False)
        self.state = DONE
        self.ctx.stats.count_response(499)

    def tick(self, now: float) -> None:
        state = self.state
        if state == STREAMING:
            if self.progress != self.seen_progress:
                self.seen_progress = self.progress
                self.progress_at = now
            elif now - self.progress_at >= self.ctx.config.stream_idle_timeout:
                self.cut()
        elif state == WAIT_REPLICA:
            if now >= self.deadline_at:
                self.respond(http.DEADLINE, 504)
            elif now >= self.empty_until:
                self.respond(http.NO_REPLICA, 503)
            elif self.heartbeat_at and now >= self.heartbeat_at:
                self.heartbeat(now)
        elif state == SENT and self.upload_at:
            # The client is still sending the body: the idle timeout governs, not the deadline.
            if self.progress != self.seen_progress:
                self.seen_progress = self.progress
                self.progress_at = now
            elif now - self.progress_at >= self.ctx.config.stream_idle_timeout:
                self.respond(http.REQUEST_TIMEOUT, 408, close=True)
        elif state == WAIT_CONN or state == SENT:
            if now >= self.deadline_at:
                self.respond(http.DEADLINE, 504)
        elif self.awaiting_body and now - self.started >= _ROUTE_WAIT:
            self.route_now()  # a slow body: route on what arrived
