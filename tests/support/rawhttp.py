"""A raw HTTP/1.1 client for the proxy tests: exact bytes out, exact framing in.

aiohttp normalises what it sends and hides how a response was framed; these
tests need both (pipelining, smuggling attempts, slowloris, chunked versus
close-delimited replies), so they speak HTTP over asyncio streams.

    async with connect(port) as conn:
        conn.send(b"GET /fast HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
        resp = await conn.response()
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

HOST = "127.0.0.1"
READ_TIMEOUT = 10.0


class HeaderList:
    """Lookups over `self.headers`, the (name, value) pairs as received (names in any
    case, repeats kept)."""

    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        values = self.all(name)
        return values[0] if values else None

    def all(self, name: str) -> list[str]:
        lname = name.lower()
        return [v for k, v in self.headers if k.lower() == lname]

    @property
    def names(self) -> set[str]:
        return {k.lower() for k, _ in self.headers}


@dataclass
class Response(HeaderList):
    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    framing: str = "none"  # "length", "chunked", "close" or "none" (no body by definition)
    chunks: list[bytes] = field(default_factory=list)  # chunk payloads as received


async def read_head(reader: asyncio.StreamReader) -> tuple[int, list[tuple[str, str]]]:
    line = await reader.readline()
    if not line:
        raise ConnectionResetError("connection closed before a response")
    version, status, *_ = line.decode("latin-1").split(" ", 2)
    assert version.startswith("HTTP/1."), line
    headers: list[tuple[str, str]] = []
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            return int(status), headers
        if not line:
            raise asyncio.IncompleteReadError(b"", None)
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name, value.strip()))


async def read_chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """Yield chunk payloads until the last chunk; IncompleteReadError if cut short."""
    while True:
        size_line = await reader.readline()
        if not size_line.endswith(b"\n"):
            raise asyncio.IncompleteReadError(size_line, None)
        size = int(size_line.split(b";")[0].strip(), 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def read_response(
    reader: asyncio.StreamReader, *, head: bool = False, skip_1xx: bool = True
) -> Response:
    """One response; `head=True` when it answers a HEAD request (no body follows)."""
    async with asyncio.timeout(READ_TIMEOUT):
        status, headers = await read_head(reader)
        while skip_1xx and 100 <= status < 200:
            status, headers = await read_head(reader)
        resp = Response(status, headers)
        if head or status in (204, 304) or status < 200:
            return resp
        te = resp.header("Transfer-Encoding")
        length = resp.header("Content-Length")
        if te is not None and "chunked" in te.lower():
            resp.framing = "chunked"
            resp.chunks = [c async for c in read_chunks(reader)]
            resp.body = b"".join(resp.chunks)
        elif length is not None:
            resp.framing = "length"
            resp.body = await reader.readexactly(int(length))
        else:
            resp.framing = "close"
            resp.body = await reader.read()
        return resp


class RawConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def response(self, *, head: bool = False, skip_1xx: bool = True) -> Response:
        await self.writer.drain()
        return await read_response(self.reader, head=head, skip_1xx=skip_1xx)

    async def request(self, data: bytes, *, head: bool = False) -> Response:
        self.send(data)
        return await self.response(head=head)

    async def closed_by_peer(self, within: float) -> bool:
        """True when the peer closes (EOF or reset) within `within` seconds; data is drained."""
        try:
            async with asyncio.timeout(within):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True

    def abort(self) -> None:
        transport = self.writer.transport
        transport.abort()


@contextlib.asynccontextmanager
async def connect(
    port: int, *, ssl_context: ssl.SSLContext | None = None, limit: int = 1 << 22
) -> AsyncIterator[RawConnection]:
    reader, writer = await asyncio.open_connection(HOST, port, ssl=ssl_context, limit=limit)
    try:
        yield RawConnection(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


def get(
    path: str, *headers: str, method: str = "GET", body: bytes = b"", host: str = "proxy.test"
) -> bytes:
    """A request's bytes: `headers` are "Name: value" lines; Content-Length added for a body."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def fetch(port: int, data: bytes, *, head: bool = False) -> Response:
    """Send one request on a new connection and read its response."""
    async with connect(port) as conn:
        return await conn.request(data, head=head)
