"""A minimal, fast HTTP/1.1 replica for benchmarks, so the replica is never the bottleneck.

Raw asyncio protocol on uvloop with httptools (llhttp) parsing; keep-alive and
pipelining. Every path answers 100 bytes, except ``/sse?delay=S`` (default
0.02): a chunked ``text/event-stream`` whose first event is written with the
headers at once and whose second event follows ``delay`` seconds later.

    python bench/fast_replica.py --port P [--id ID]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from urllib.parse import parse_qs, urlsplit

import httptools
import uvloop

BODY = b"x" * 99 + b"\n"


class Replica(asyncio.Protocol):
    def __init__(self, response: bytes, sse_head: bytes) -> None:
        self.response = response
        self.sse_head = sse_head
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.keep_alive = True
        self.out: list[bytes] = []
        self.streaming = False  # responses behind a stream wait for it (pipelining order)
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.out.append(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            self.close_after = True
        self.flush()

    def flush(self) -> None:
        if self.transport is None or self.streaming:
            return
        if self.out:
            self.transport.write(b"".join(self.out))
            self.out.clear()
        if self.close_after:
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_headers_complete(self) -> None:
        # Read keep-alive here: after the message llhttp reports False.
        self.keep_alive = self.parser.should_keep_alive()

    def on_message_complete(self) -> None:
        if self.close_after:
            return
        if self.url.startswith(b"/sse") and not self.streaming:
            self.start_stream()
        else:
            self.out.append(self.response)
        self.close_after = not self.keep_alive

    def start_stream(self) -> None:
        query = parse_qs(urlsplit(self.url.decode("latin-1")).query)
        delay = float(query.get("delay", ["0.02"])[0])
        self.flush()
        assert self.transport is not None
        self.transport.write(self.sse_head + chunk(b"data: first\n\n"))
        self.streaming = True
        asyncio.get_running_loop().call_later(delay, self.end_stream)

    def end_stream(self) -> None:
        self.streaming = False
        if self.transport is not None:
            self.transport.write(chunk(b"data: last\n\n") + b"0\r\n\r\n")
            self.flush()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve(host: str, port: int, replica_id: str) -> None:
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n"
        b"X-Replica-Id: %s\r\n\r\n%s" % (replica_id.encode(), BODY)
    )
    sse_head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\nX-Replica-Id: %s\r\n\r\n" % replica_id.encode()
    )
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Replica(response, sse_head), host, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()  # the process exits next; open keep-alive connections die with it


def main() -> None:
    p = argparse.ArgumentParser(description="minimal fast HTTP/1.1 replica for benchmarks")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--id", default=None)
    args = p.parse_args()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args.host, args.port, args.id or str(args.port)))


if __name__ == "__main__":
    main()
