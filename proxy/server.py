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
connections; an Exchange's own deadlines in `Exchange.tick`. A streaming exchange
(whose only check is its idle timeout) is looked at every 10th tick, once a second.

Request-head rules (README, "Protocol hygiene"): exactly one Host (HTTP/1.0 may
omit it), absolute-form targets rewritten to origin-form, framing headers never
removed by a `Connection` token, X-Forwarded-For combined with the peer
appended, X-Real-IP set from the peer, a client's Forwarded dropped. Body bytes
parsed from one client read go upstream in one write (`Exchange.flush_upstream`).

Bounds (docs/security.md, "Bounds"): at most `max_connections` client connections
(past it a new one is closed at once, logged once, counted, and idle ones close after
1 s instead of their timeouts, to make room); a connection that sends nothing is
closed after `header_timeout`; at most `max_pipeline` parsed requests wait
behind the one being answered (past it parsing stops, and the connection closes after
answering those, as RFC 9112 9.3.2 lets a server do); a client that left while its
request is held with reading paused is noticed (proxy/peer.py) and never reaches a replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from functools import partial

import httptools

from proxy import http, peer
from proxy.accesslog import AccessLog
from proxy.config import ProxyConfig
from proxy.exchange import DONE, STREAMING, WAIT_REPLICA, Exchange
from proxy.failures import FailureLog
from proxy.interfaces import PAUSE_PIPELINE, Upload
from proxy.readyset import ReadySet
from proxy.resume import ResumableExchange, resumable_kind
from proxy.stats import Stats
from proxy.warmup import Warmer

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


IDLE_AT_CAPACITY = 1.0  # at the cap: idle connections (silent, or kept alive) close this soon
STREAM_SWEEP_EVERY = 10  # sweeper ticks (100 ms) between looks at a streaming exchange


class _Overflow(Exception):
    """Raised inside a parser callback: the pipeline is full, parse no further."""


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
        self.max_connections = config.max_connections  # lowered to fit the fd limit (app.py)
        self.at_capacity = False  # logged once until the count falls back under 90 %
        self.ticks = 0
        self.suspects: list[ClientConnection] = []  # held with reading paused: left?
        self.access_log: AccessLog | None = None  # --access-log; set by the app
        self.failures = FailureLog(config.service)  # 502/503/504 warnings, rate-limited
        self.warmer = Warmer(stats)  # prefix warm_copies' warm-ups (proxy/warmup.py)

    def tick(self) -> None:
        now = self.now = self.loop.time()
        ticks = self.ticks = self.ticks + 1
        # A streaming exchange has only its idle timeout (120 s by default) to check: once a
        # second is enough, and skipping it inline keeps 10,000 open streams cheap to sweep.
        streams_too = ticks % STREAM_SWEEP_EVERY == 0
        for conn in list(self.connections):
            ex = conn.current
            if streams_too or ex is None or ex.state != STREAMING:
                conn.tick(now)
        self.ready_set.sweep()
        if streams_too:  # once a second
            self.ready_set.refresh_placement(time.time())
        open_now = self.stats.connections_open = len(self.connections)
        if self.at_capacity and open_now < self.max_connections * 0.9:
            self.at_capacity = False
            log.warning("client connections back under the cap (%d open)", open_now)
        if self.suspects:
            suspects, self.suspects = self.suspects, []
            for conn in peer.departed(suspects):
                conn.drop_departed()
        if self.access_log is not None:
            self.access_log.flush()
        self.failures.flush(now)

    def refuse(self, transport: asyncio.BaseTransport) -> None:
        """A connection past --max-connections: closed at once, counted, logged once."""
        self.stats.connections_refused += 1
        transport.close()
        if not self.at_capacity:
            self.at_capacity = True
            log.warning("client connections at the cap (--max-connections %d): new ones "
                        "are closed at once, idle ones after %.0f s, until under 90 %%",
                        self.max_connections, IDLE_AT_CAPACITY)


class ClientConnection(asyncio.Protocol):
    __slots__ = (
        "continue_due",
        "ctx",
        "current",
        "fresh",
        "head_read",
        "head_started",
        "header_bytes",
        "headers",
        "http11",
        "idle_since",
        "overflowed",
        "parser",
        "pause_mask",
        "peer",
        "peer_tail",
        "pending",
        "reading",
        "transport",
        "upgrade_ignored",
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
        self.fresh = True  # no request begun yet: --header-timeout is the idle limit
        self.overflowed = False  # the pipeline filled up: parse nothing more, close after
        self.upgrade_ignored = False  # an h2c upgrade request, served as HTTP/1.1
        self.continue_due: set[Exchange] | None = None  # queued requests owed a 100 Continue

    # -- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if len(self.ctx.connections) >= self.ctx.max_connections:
            self.ctx.refuse(transport)
            return
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
        except httptools.HttpParserUpgrade as exc:
            if not self.upgrade_ignored:
                self.reject(http.UPGRADE_REFUSED, 501)
                return
            # An h2c upgrade, served as HTTP/1.1 (RFC 9110 7.8: a server may ignore
            # Upgrade). llhttp stops after that message: parse the rest with a new parser.
            self.upgrade_ignored = False
            self.parser = httptools.HttpRequestParser(self)
            self.flush_upload()
            rest = data[exc.args[0]:]
            if rest and self.transport is not None and not self.overflowed:
                self.data_received(rest)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self.reject(cause.response, cause.status)
            elif isinstance(cause, _Overflow):
                self.flush_upload()
                self.overflow()
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

    def flush_upload(self) -> None:
        upload = self.upload
        if upload is not None:
            self.upload = None
            upload.flush_upstream()

    def overflow(self) -> None:
        """More pipelined requests than --max-pipeline: stop parsing; answer the queued ones,
        the last with `Connection: close` (the client resends the rest, RFC 9112 9.3.2)."""
        self.overflowed = True
        self.ctx.stats.pipeline_overflows += 1
        self.pause_reading_for(PAUSE_PIPELINE)
        last = self.pending[-1] if self.pending else self.current
        if last is not None:
            last.close_after = True
        else:
            self.close_if_idle()

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
        self.fresh = False
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
        if self.current is not None and len(self.pending) >= self.ctx.config.max_pipeline:
            raise _Overflow
        parser = self.parser
        method: bytes = parser.get_method()
        if parser.should_upgrade():
            self.upgrade_ignored = method != b"CONNECT" and self._only_h2c()
            if not self.upgrade_ignored:
                raise _Reject(http.UPGRADE_REFUSED, 501)
        started = self.head_started
        self.head_started = 0.0
        version = parser.get_http_version()
        http11 = self.http11 = version == "1.1"
        if not http11 and version != "1.0":  # llhttp also reads 0.9 and 2.0 request lines
            if version == "2.0":
                raise _Reject(http.VERSION_REFUSED, 505)
            raise _Reject(http.BAD_REQUEST, 400)
        keep, host, xff, chunked, length, connection, expect = self._scan_headers(http11)
        url = self.url
        if url[:1] != b"/":
            if url != b"*":
                url, host = _origin_form(url)  # absolute-form: its authority replaces Host
            elif method != b"OPTIONS":
                raise _Reject(http.BAD_TARGET, 400)  # asterisk-form is OPTIONS' alone
        if connection is not None:
            keep = http.drop_named_hop(keep, connection)
        keep.append(b"X-Forwarded-For: %s%s\r\n" % (xff, self.peer))
        keep.append(self.peer_tail)
        if host:
            keep.append(b"X-Forwarded-Host: %s\r\n" % host)
        if chunked:
            keep.append(b"Transfer-Encoding: %s\r\n" % chunked)
        keep.append(http.CRLF)
        kind = resumable_kind(method, url) if self.ctx.ready_set.resume_streams else None
        ex = (Exchange if kind is None else partial(ResumableExchange, kind=kind))(
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
        # RFC 9110 10.1.1: a 100-continue expectation from HTTP/1.0 is ignored.
        expect = expect and http11
        if self.current is None:
            self.current = ex
            if expect:
                self.transport.write(http.CONTINUE_100)  # type: ignore[union-attr]
            ex.start()
        else:
            self.pending.append(ex)
            if expect:  # its 100 goes out when its turn comes (exchange_done)
                if self.continue_due is None:
                    self.continue_due = set()
                self.continue_due.add(ex)
            self.pause_reading_for(PAUSE_PIPELINE)

    def _only_h2c(self) -> bool:
        """The request's Upgrade asks for h2c alone (served as HTTP/1.1, upgrade ignored)."""
        tokens: set[bytes] = set()
        for name, value in self.headers:
            if name.lower() == b"upgrade":
                tokens |= http.connection_tokens(value)
        return tokens == {b"h2c"}

    def _scan_headers(self, http11: bool) -> tuple[
            list[bytes], bytes, bytes, bytes, int, bytes | None, bool]:
        """Sort the request's headers: the lines forwarded as they are, and what the
        proxy decides itself (Host, X-Forwarded-For, Transfer-Encoding, Content-Length,
        Connection, Expect). Refuses ambiguous framing, a bad Host and an oversized body.

        Returns (kept lines, host, X-Forwarded-For prefix, Transfer-Encoding values,
        Content-Length, the Connection values comma-joined or None, Expect: 100-continue).
        """
        keep = []
        host = b""
        n_host = 0
        xff = b""
        chunked = b""  # the Transfer-Encoding values; re-chunked upstream as received
        expect = False
        n_length = 0
        length = 0
        connection: bytes | None = None  # the Connection values, comma-joined
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
                    # RFC 9110 10.1.1: an expectation other than 100-continue gets 417.
                    if value.strip().lower() != b"100-continue":
                        raise _Reject(http.EXPECT_REFUSED, 417)
                    expect = True
                elif lname == b"connection":
                    connection = value if connection is None else connection + b"," + value
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
            elif b"_" in lname and lname.replace(b"_", b"-") in http.UNDERSCORE_DROP:
                continue  # X_Real_IP would reach a WSGI replica as HTTP_X_REAL_IP
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
            if not self.pending and not self.overflowed:
                self.resume_reading_for(PAUSE_PIPELINE)
            due = self.continue_due
            if due is not None and nxt in due:
                due.discard(nxt)
                if not nxt.body_done:
                    transport.write(http.CONTINUE_100)
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

    def departed(self) -> bool:
        """True (and the connection aborted) when the client left while its reading is
        paused, so its EOF was never read; for a held request about to be sent."""
        if not self.pause_mask or self.transport is None or not peer.departed([self]):
            return False
        self.drop_departed()
        return True

    def drop_departed(self) -> None:
        self.ctx.stats.departed_while_held += 1
        if self.transport is not None:
            self.transport.abort()

    def tick(self, now: float) -> None:
        ex = self.current
        if ex is not None:
            ex.tick(now)
            if self.pause_mask and ex.state == WAIT_REPLICA and self.ctx.ticks % 10 == 0:
                self.ctx.suspects.append(self)  # checked in one poll by ServerContext.tick
            return
        transport = self.transport
        if transport is None:
            return
        cfg = self.ctx.config
        if self.head_started:
            if now - self.head_started > cfg.header_timeout:
                transport.abort()  # slowloris: the head never completed
        else:
            idle = now - self.idle_since
            if idle > (cfg.header_timeout if self.fresh else cfg.keepalive_timeout) or (
                    idle > IDLE_AT_CAPACITY and self.ctx.at_capacity):
                # Idle: not a byte since the accept, or since the last response. At the cap,
                # idle ones make room for clients with requests (as nginx reuses them).
                transport.close()
