"""One keep-alive connection to a replica: an asyncio.Protocol with llhttp's response parser.

The connection serves one exchange at a time (no upstream pipelining) and hands
every parser event straight to it. Writes to the client are collected while a
read is parsed and sent as one write at the end of the read (or at the end of
the response, whichever is first), so a small response costs one syscall.

Traps handled here: keep-alive is read in on_headers_complete (llhttp reports
false once feed_data has returned from the message; read there, every pooled
connection would close: measured 3x the CPU per request); a response to HEAD
ends at its headers, and the parser is replaced afterwards because it cannot
know the request was HEAD; 1xx responses are separate messages and are
skipped; a close-delimited body ends in connection_lost.

A complete response is handed back (and the connection released to the pool, maybe
to a waiting exchange) only after feed_data returns, never from inside a parser
callback: llhttp goes on parsing the rest of the buffer, and whatever follows a
complete response (a second response the replica should not have sent) would
otherwise be read as the next exchange's response. Anything after a complete
response in the same read closes the connection instead; bytes on an idle
connection do too. Header lists are reset at each message start, so trailers
(which llhttp reports through on_header) never reach the next response, and
header count and size are bounded (502).
"""

from __future__ import annotations

import asyncio
import logging

import httptools

from proxy.interfaces import PAUSE_UPSTREAM, ConnectionOwner, ResponseSink

log = logging.getLogger("sluice.proxy")

# Bounds on one response head (and its trailers) from a replica.
MAX_HEADERS = 256
MAX_HEADER_BYTES = 256 * 1024


class _HeadersTooLarge(Exception):
    pass


class UpstreamConnection(asyncio.Protocol):
    """A connection to a replica (an interfaces.UpstreamLink); its exchange is an
    interfaces.ResponseSink, its pool an interfaces.ConnectionOwner."""

    __slots__ = (
        "body_framed",
        "closed",
        "done",
        "exchange",
        "extra",
        "header_bytes",
        "headers",
        "idle_since",
        "in_response",
        "keep_alive",
        "parser",
        "paused",
        "pool",
        "reset",
        "reset_parser",
        "served",
        "status",
        "transport",
    )

    def __init__(self, pool: ConnectionOwner) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: ResponseSink | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.done: ResponseSink | None = None  # its response completed in the read being parsed
        self.extra = False  # the replica sent bytes after a complete response
        self.status = 0
        self.keep_alive = False
        self.closed = False
        self.served = 0  # responses completed on this connection (0: fresh)
        self.idle_since = 0.0  # when the pool last took it back (its coarse clock)
        self.in_response = False  # headers seen, body not finished
        self.body_framed = True  # False: the body ends when the connection closes
        self.reset_parser = False
        self.reset = False  # lost with an error (set just before on_upstream_lost)
        self.paused = False  # reading paused because the client reads slowly

    # -- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:
            # Bytes on an idle connection: the replica is confused; drop the connection.
            self.abort()
            return
        failed = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            failed = True
            cause = exc.__context__
            if isinstance(cause, _HeadersTooLarge):
                ex = self.exchange
                if ex is not None:
                    ex.on_upstream_error("UpstreamHeadersTooLarge")  # detaches and aborts
            else:
                log.error("response path bug, upstream connection dropped", exc_info=cause)
        except httptools.HttpParserError:
            failed = True  # the replica spoke malformed HTTP
        done = self.done
        if done is not None:
            self.done = None
            if self.reset_parser:
                self.reset_parser = False
                self.parser = httptools.HttpResponseParser(self)
            # Released only now that llhttp is done with this read, and never reused when
            # anything followed the response in it.
            done.on_response_complete(
                self, reusable=self.keep_alive and not failed and not self.extra)
        if failed:
            self.abort()
            return
        ex = self.exchange
        if ex is not None:
            ex.flush_client()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.discard(self)
        ex = self.exchange
        if ex is not None:
            self.exchange = None
            if self.in_response and not self.body_framed:
                ex.on_response_complete(self, reusable=False)
            else:
                self.reset = exc is not None
                ex.on_upstream_lost(self, self.in_response)

    def pause_writing(self) -> None:
        ex = self.exchange
        if ex is not None:
            ex.client.pause_reading_for(PAUSE_UPSTREAM)

    def resume_writing(self) -> None:
        ex = self.exchange
        if ex is not None:
            ex.client.resume_reading_for(PAUSE_UPSTREAM)

    # -- llhttp callbacks -----------------------------------------------------

    def on_message_begin(self) -> None:
        if self.exchange is None:
            self.extra = True  # a message after the complete response: nobody asked for it
        self.headers = []  # also drops the previous message's trailers
        self.header_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.headers
        headers.append((name, value))
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES or len(headers) > MAX_HEADERS:
            raise _HeadersTooLarge

    def on_headers_complete(self) -> None:
        ex = self.exchange
        if ex is None:
            return  # a message after the complete response (`extra`): read by nobody
        status = self.parser.get_status_code()
        self.status = status
        if status < 200:
            # 1xx: an interim message; the real response follows. 101 is never asked for.
            if status == 101:
                self.abort()
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.in_response = True
        if ex.on_response_headers(self, status, self.headers) and self.exchange is ex:
            # HEAD: no body follows, whatever the headers say; llhttp does not know that,
            # so any bytes after the head in this read show up as body: `extra`.
            self.reset_parser = True
            self.in_response = False
            self.exchange = None
            self.done = ex

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        if ex is not None:
            ex.on_response_body(body)
        else:
            self.extra = True

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        if not self.in_response:
            return  # HEAD response already completed at its headers
        self.in_response = False
        ex = self.exchange
        if ex is not None:
            self.exchange = None
            self.done = ex

    # -- used by the exchange and the pool --------------------------------------

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.closed:
            transport.write(data)

    def abort(self) -> None:
        """Drop the connection at once (the replica sees the disconnect)."""
        transport = self.transport
        if transport is not None and not self.closed:
            transport.abort()

    def close(self) -> None:
        transport = self.transport
        if transport is not None and not self.closed:
            transport.close()

    def pause_reading(self) -> None:
        transport = self.transport
        if transport is not None and not self.closed and not self.paused:
            self.paused = True
            transport.pause_reading()

    def resume_reading(self) -> None:
        transport = self.transport
        if transport is not None and not self.closed and self.paused:
            self.paused = False
            transport.resume_reading()
