"""The listener side of the request path: the client connection protocol and what all
connections of one process share.

A ClientConnection parses requests with llhttp (httptools), checks and rewrites
each request head, and turns it into an Exchange (proxy/exchange.py: one
request's state machine), one at a time per connection; pipelined requests wait
their turn. The common path runs entirely in protocol callbacks: no Task, no
Future, no logging, no timer object.

Timeouts are enforced by one sweeper per process (`ServerContext.tick`, every
100 ms) that looks at absolute deadlines and progress counters, instead of a
timer per request: here the time to read a request head and idle keep-alive
connections; an Exchange's own deadlines in `Exchange.tick`.

Request-head rules (README, "Protocol hygiene"): exactly one Host (HTTP/1.0 may
omit it), absolute-form targets rewritten to origin-form, framing headers never
removed by a `Connection` token, X-Forwarded-For combined with the peer
appended, X-Real-IP set from the peer, a client's Forwarded dropped. Body bytes
parsed from one client read go upstream in one write (`Exchange.flush_upstream`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import httptools

from proxy import http
from proxy.accesslog import AccessLog
from proxy.config import ProxyConfig
from proxy.exchange import DONE, Exchange
from proxy.interfaces import PAUSE_PIPELINE, Upload
from proxy.readyset import ReadySet
from proxy.stats import Stats

log = logging.getLogger("sluice.proxy")

# Bytes a Host value (uri-host [":" port], RFC 3986) may hold: deleting these must leave b"".
_HOST_BYTES = (b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
               b"-._~!$&'()*+;=:[]%")


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
        self.access_log: AccessLog | None = None  # --access-log; set by the app

    def tick(self) -> None:
        now = self.now = self.loop.time()
        for conn in list(self.connections):
            conn.tick(now)
        self.ready_set.sweep()
        if self.access_log is not None:
            self.access_log.flush()


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
        self.upload: Upload | None = None  # request body bytes to send at the end of a read
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
        if parser.should_upgrade():
            raise _Reject(http.UPGRADE_REFUSED, 501)
        started = self.head_started
        self.head_started = 0.0
        method: bytes = parser.get_method()
        http11 = self.http11 = parser.get_http_version() == "1.1"
        keep, host, xff, chunked, length, connection, expect = self._scan_headers(http11)
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
            self.ctx,
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

    def _scan_headers(self, http11: bool) -> tuple[
            list[bytes], bytes, bytes, bytes, int, list[bytes] | None, bool]:
        """Sort the request's headers: the lines forwarded as they are, and what the
        proxy decides itself (Host, X-Forwarded-For, Transfer-Encoding, Content-Length,
        Connection, Expect). Refuses ambiguous framing, a bad Host and an oversized body.

        Returns (kept lines, host, X-Forwarded-For prefix, Transfer-Encoding values,
        Content-Length, Connection values or None, Expect: 100-continue).
        """
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
        if length > self.ctx.config.max_body:
            raise _Reject(http.TOO_LARGE, 413)
        return keep, host, xff, chunked, length, connection, expect

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

    def exchange_done(self, ex: object, close: bool) -> None:
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
