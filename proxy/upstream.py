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
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httptools

if TYPE_CHECKING:
    from proxy.pool import ReplicaPool
    from proxy.server import Exchange

log = logging.getLogger("sluice.proxy")


class UpstreamConnection(asyncio.Protocol):
    __slots__ = (
        "body_framed",
        "closed",
        "exchange",
        "headers",
        "in_response",
        "keep_alive",
        "parser",
        "paused",
        "pool",
        "reset_parser",
        "served",
        "status",
        "transport",
    )

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.keep_alive = False
        self.closed = False
        self.served = 0  # responses completed on this connection (0: fresh)
        self.in_response = False  # headers seen, body not finished
        self.body_framed = True  # False: the body ends when the connection closes
        self.reset_parser = False
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
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            log.error("response path bug, upstream connection dropped", exc_info=exc.__context__)
            self.abort()
            return
        except httptools.HttpParserError:
            self.abort()  # the replica spoke malformed HTTP
            return
        if self.reset_parser:
            self.reset_parser = False
            self.parser = httptools.HttpResponseParser(self)
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
                ex.on_upstream_lost(self, self.in_response)

    def pause_writing(self) -> None:
        ex = self.exchange
        if ex is not None:
            ex.client.pause_reading_for(4)

    def resume_writing(self) -> None:
        ex = self.exchange
        if ex is not None:
            ex.client.resume_reading_for(4)

    # -- llhttp callbacks -----------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self.status = status
        if status < 200:
            # 1xx: an interim message; the real response follows. 101 is never asked for.
            if status == 101:
                self.abort()
            self.headers = []
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.in_response = True
        ex = self.exchange
        if ex is not None:
            headers = self.headers
            self.headers = []
            if ex.on_response_headers(self, status, headers) and self.exchange is ex:
                # HEAD: no body follows, whatever the headers say.
                self.reset_parser = True
                self.in_response = False
                ex.on_response_complete(self, reusable=self.keep_alive)

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        if ex is not None:
            ex.on_response_body(body)

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        if not self.in_response:
            return  # HEAD response already completed at its headers
        self.in_response = False
        ex = self.exchange
        if ex is not None:
            ex.on_response_complete(self, reusable=self.keep_alive)

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
