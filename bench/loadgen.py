"""A built-in HTTP/1.1 load generator, used by the benchmarks when wrk is not installed.

N keep-alive connections, each sending one GET (or POST, --body-file) at a time for D seconds; raw
asyncio protocols on uvloop with httptools parsing, so one process reaches a
few tens of thousands of requests/s (wrk is several times faster: prefer it).
Prints one JSON object: requests, errors, non_2xx, seconds, rps, p50_ms, p99_ms.

    python bench/loadgen.py http://127.0.0.1:8080/fast -c 64 -d 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools
import uvloop


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    non_2xx: int = 0


class Connection(asyncio.Protocol):
    """One keep-alive connection: send, wait for the whole response, repeat until `until`."""

    def __init__(self, requests: list[bytes], until: float, stats: Stats, first: int = 0) -> None:
        self.requests = requests
        self.next = first % len(requests)
        self.until = until
        self.stats = stats
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0.0
        self.keep_alive = True
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.send()

    def send(self) -> None:
        assert self.transport is not None
        self.sent_at = time.perf_counter()
        i = self.next
        self.next = i + 1 if i + 1 < len(self.requests) else 0
        self.transport.write(self.requests[i])

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.fail()

    def on_headers_complete(self) -> None:
        # llhttp's keep-alive flag is only meaningful here; after the message it reads False.
        self.keep_alive = self.parser.should_keep_alive()

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        self.stats.latencies.append(now - self.sent_at)
        if not 200 <= self.parser.get_status_code() < 300:
            self.stats.non_2xx += 1
        if now < self.until and self.keep_alive:
            self.send()
        else:
            self.finish()

    def fail(self) -> None:
        self.stats.errors += 1
        self.finish()

    def finish(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.done.done():  # closed by the peer mid-run
            self.stats.errors += 1
            self.done.set_result(None)


async def run(url: str, connections: int, duration: float,
              bodies: list[bytes] | None = None) -> dict[str, float | int | None]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if bodies:
        requests = [f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n"
                    .encode() + b for b in bodies]
    else:
        requests = [f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode()]
    stats = Stats()
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    until = start + duration
    conns: list[Connection] = []
    for i in range(connections):
        try:
            _, proto = await loop.create_connection(
                lambda i=i: Connection(requests, until, stats, i), host, port  # type: ignore[misc]
            )
            conns.append(proto)
        except OSError:
            stats.errors += 1
    # Bounded: a connection stuck on a response that never comes is not waited for forever.
    if conns:
        await asyncio.wait([c.done for c in conns], timeout=duration + 10)
    for c in conns:
        c.finish()
    elapsed = time.perf_counter() - start
    lat = sorted(stats.latencies)

    def pct(p: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 3) if lat else None

    return {
        "requests": len(lat),
        "errors": stats.errors,
        "non_2xx": stats.non_2xx,
        "seconds": round(elapsed, 3),
        "rps": round(len(lat) / elapsed, 1),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
    }


def main() -> None:
    p = argparse.ArgumentParser(description="built-in HTTP/1.1 keep-alive load generator")
    p.add_argument("url")
    p.add_argument("-c", "--connections", type=int, default=64)
    p.add_argument("-d", "--duration", type=float, default=5.0)
    p.add_argument("--body-file", help="POST instead of GET: a JSON list of bodies (strings), "
                   "sent in turn on each connection")
    args = p.parse_args()
    bodies = None
    if args.body_file:
        with open(args.body_file) as f:
            bodies = [b.encode() for b in json.load(f)]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(run(args.url, args.connections, args.duration, bodies))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
