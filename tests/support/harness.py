"""What the proxy tests run the proxy against and measure it with, besides the replica app.

- `BASE_ARGS`: command-line options every proxy process in these tests gets
  (loopback only, a short drain so teardown is quick).
- `ManualSource` and `inprocess_proxy()`: a ProxyApp in the test's own loop
  whose ready set the test drives snapshot by snapshot.
- `ScriptedUpstream`: an in-loop HTTP/1.1 server that answers with exact
  bytes the test chose and records exactly what it received and how many
  connections it got (what aiohttp's server cannot be made to do); a route that
  returns `HOLD` leaves the reply to the test (`await upstream.held.get()`).
- `get_json()`, `scrape()`, `metric()`, `replica_stats()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httptools
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import ProxyApp
from proxy.config import ProxyConfig
from proxy.readyset import ReadySet
from proxy.wire.snapshot import ReadyReplica
from tests.support.builders import snapshot
from tests.support.ports import HOST
from tests.support.processes import Replica
from tests.support.rawhttp import HeaderList

BASE_ARGS = ("--host", HOST, "--shutdown-grace", "2")

async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def scrape(admin_url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the admin /metrics page as (name, labels, value)."""
    async with aiohttp.ClientSession() as s, s.get(f"{admin_url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return [
        (smp.name, smp.labels, smp.value)
        for fam in text_string_to_metric_families(text)
        for smp in fam.samples
    ]


def metric(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        v
        for n, lab, v in samples
        if n == name and all(lab.get(k) == want for k, want in labels.items())
    )


async def replica_stats(replica: Replica) -> dict[str, Any]:
    return await asyncio.to_thread(replica.stats)


# -- an in-process proxy with a ready set the test drives -------------------------------


class ManualSource:
    """A ready-set source that publishes exactly what the test tells it to."""

    def __init__(self) -> None:
        self.ready_set: ReadySet | None = None
        self.generation = 0
        self.closed = False

    async def start(self, ready_set: ReadySet) -> None:
        self.ready_set = ready_set

    async def aclose(self) -> None:
        self.closed = True

    def publish(self, *replicas: str | ReadyReplica, policy: str = "least_load") -> None:
        assert self.ready_set is not None, "start the proxy first"
        self.generation += 1
        applied = self.ready_set.apply(
            snapshot(
                self.generation,
                *replicas,
                service="test",
                first_id=1,
                published_at=time.time(),
                policy=policy,
                active_versions=[1],
            )
        )
        assert applied


@contextlib.asynccontextmanager
async def inprocess_proxy(source: ManualSource, **options: Any) -> AsyncIterator[ProxyApp]:
    """A started ProxyApp on a free loopback port (`app.port`); closed on exit."""
    settings: dict[str, Any] = {
        "host": HOST,
        "port": 0,
        "admin_port": None,
        "shutdown_grace": 1.0,
        **options,
    }
    app = ProxyApp(ProxyConfig(**settings), source=source)
    await app.start()
    try:
        yield app
    finally:
        await app.aclose()


# -- a scripted upstream -----------------------------------------------------------


@dataclass
class SeenRequest(HeaderList):
    method: str = ""
    url: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


Reply = Callable[[SeenRequest], bytes]

# A reply that a route returns to answer later: the connection goes to `ScriptedUpstream.held`
# and the test writes the reply itself with `answer()`.
HOLD = b"<hold>"


class _ScriptedConnection(asyncio.Protocol):
    def __init__(self, server: ScriptedUpstream) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.current = SeenRequest()
        self.keep_alive = True
        self.answered_at: float | None = None  # loop time of its last reply

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections += 1
        self.server.open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.open.discard(self)

    def data_received(self, data: bytes) -> None:
        self.server.raw += data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.current = SeenRequest()

    def on_url(self, url: bytes) -> None:
        self.current.url += url.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self.current.body += body

    def on_message_complete(self) -> None:
        req = self.current
        req.method = self.parser.get_method().decode()
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it after the feed
        self.server.requests.append(req)
        assert self.transport is not None
        race = self.server.idle_race
        if (race is not None and self.answered_at is not None
                and asyncio.get_running_loop().time() - self.answered_at >= race):
            # This server's keep-alive timer fired as the request arrived: closed unanswered.
            self.server.raced += 1
            self.transport.close()
            return
        reply = self.server.reply(req)
        if reply is HOLD:
            self.server.held.put_nowait(self)
            return
        if not reply:  # an empty reply: close without answering (a keep-alive race)
            self.transport.close()
            return
        self.answer(reply)

    def answer(self, reply: bytes) -> None:
        assert self.transport is not None
        self.transport.write(reply)
        self.answered_at = asyncio.get_running_loop().time()
        head = reply.split(b"\r\n\r\n", 1)[0].lower()
        if b"connection: close" in head or not self.keep_alive:
            self.transport.close()


class ScriptedUpstream:
    """An HTTP/1.1 server in the test's loop; `routes` maps a path to the exact reply bytes
    (or to a function of the request returning them; b"" closes the connection unanswered).

    `idle_race`: a request that arrives on a connection idle at least this many seconds
    since its last reply is closed unanswered and counted in `raced`: what a server whose
    keep-alive timeout (uvicorn's and llama-server's 5 s) fires as the request arrives
    does to it."""

    def __init__(self, routes: dict[str, bytes | Reply], idle_race: float | None = None) -> None:
        self.routes = routes
        self.idle_race = idle_race
        self.raced = 0
        self.requests: list[SeenRequest] = []
        self.raw = b""
        self.connections = 0
        self.open: set[_ScriptedConnection] = set()
        self.held: asyncio.Queue[_ScriptedConnection] = asyncio.Queue()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def unsent(self) -> int:
        """Reply bytes written but still queued in this server's transports (not yet taken
        by the peer): what backpressure from the peer holds back."""
        return sum(c.transport.get_write_buffer_size() for c in self.open
                   if c.transport is not None)

    def reply(self, req: SeenRequest) -> bytes:
        route = self.routes.get(req.url.split("?", 1)[0])
        if route is None:
            return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
        return route if isinstance(route, bytes) else route(req)

    async def __aenter__(self) -> ScriptedUpstream:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ScriptedConnection(self), HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for conn in list(self.open):
            if conn.transport is not None:
                conn.transport.abort()
        await self._server.wait_closed()
