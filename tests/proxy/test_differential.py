"""A differential, property-based test of the request path (hypothesis).

Random sessions of requests from several clients at once (methods; bodies with
Content-Length or chunked, with or without trailers; pipelined batches sent in random
pieces; `Connection` tokens, framing ones included; absolute-form targets; upgrades,
garbage and Host-less requests) go through one real sluice-proxy process
(`--pool-size` 1, then 2; two replicas) to scripted replicas. Each request names, in its path,
how the replica answers it: Content-Length, chunked, chunked with trailers, an extra
unrequested response in the same write, a 1xx first, 204, 304, `Connection: close`,
close-delimited, `Connection: content-length`, cut short by a close, or a close before
any answer (the proxy's 502; `--max-attempts 1`, so only the one free retry of a stale
pooled connection may send it a second time).

The model is the plain expectation: what each client sent, and what each replica answer
is. After every example:
- each request the proxy forwarded arrived at a replica exactly once (at most once when
  its client saw no answer; at most twice for a close before any answer), with the
  client's method, origin-form path and body bytes, and nothing else arrived (no
  smuggled request);
- each client got exactly the answers to its own requests, in order, each framed exactly
  once (one Content-Length, or chunked, never both; none for HEAD, 204 and 304);
- no byte a replica sent after a complete response reached any client;
- every client connection still open is reusable, the proxy's in-flight count returns
  to zero, and a request afterwards is served.

The proxy and the replicas start once per module; examples only open client connections.
The default run is bounded (`SLUICE_DIFF_EXAMPLES` per pool size, default 200); run longer with e.g.
`SLUICE_DIFF_EXAMPLES=2000 python -m pytest tests/proxy/test_differential.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import rawhttp
from tests.support.harness import BASE_ARGS, get_json
from tests.support.poll import until
from tests.support.ports import HOST
from tests.support.processes import Proxy, ProxyFactory

EXAMPLES = int(os.environ.get("SLUICE_DIFF_EXAMPLES", "200"))
T = TypeVar("T")

BEHAVIOURS = ("len", "chunked", "trailers", "extra", "interim", "s204", "s304", "close",
              "eof", "conncl", "cut", "early", "big")
INJECTED = b"INJECTED"


# -- scripted replicas, in a loop on a thread of their own -----------------------------------


@dataclass
class Arrival:
    method: str
    url: str
    body: bytes


def body_of(rid: str, behaviour: str = "") -> bytes:
    # "big": many reads on every hop, and more than the client transport's high-water mark.
    return f"<{rid}>".encode() * (30_000 if behaviour == "big" else 3)


def reply(rid: str, behaviour: str, head_only: bool) -> tuple[bytes, bool]:
    """The replica's answer (bytes, then close?) to request `rid`."""
    body = b"" if head_only else body_of(rid, behaviour)
    n = len(body_of(rid, behaviour))
    tag = f"X-Req: {rid}\r\n".encode()
    plain = b"HTTP/1.1 200 OK\r\n" + tag + b"Content-Length: %d\r\n\r\n" % n + body
    if behaviour in ("len", "big"):
        return plain, False
    if behaviour in ("chunked", "trailers"):
        head = b"HTTP/1.1 200 OK\r\n" + tag + b"Transfer-Encoding: chunked\r\n\r\n"
        if head_only:
            return head, False
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:3], body[3:7], body[7:]))
        end = b"0\r\nX-Leak: " + rid.encode() + b"\r\n\r\n" if behaviour == "trailers" else (
            b"0\r\n\r\n")
        return head + chunks + end, False
    if behaviour == "extra":
        return plain + (b"HTTP/1.1 200 OK\r\nX-Injected: yes\r\n" + tag
                        + b"Content-Length: %d\r\n\r\n%s" % (len(INJECTED), INJECTED)), False
    if behaviour == "interim":
        return b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + plain, False
    if behaviour == "s204":
        return b"HTTP/1.1 204 No Content\r\n" + tag + b"\r\n", False
    if behaviour == "s304":
        return b"HTTP/1.1 304 Not Modified\r\n" + tag + b"\r\n", False
    if behaviour == "close":
        return (b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + tag
                + b"Content-Length: %d\r\n\r\n" % n + body), True
    if behaviour == "eof":
        return b"HTTP/1.1 200 OK\r\n" + tag + b"\r\n" + body, True
    if behaviour == "conncl":
        return (b"HTTP/1.1 200 OK\r\nConnection: content-length\r\n" + tag
                + b"Content-Length: %d\r\n\r\n" % n + body), False
    if behaviour == "early":
        return b"", True  # closes without answering: the proxy may retry once, then 502
    assert behaviour == "cut"
    if head_only:
        # A HEAD answer is complete at its head: closing after it without saying so is the
        # plain keep-alive race (a retry's business, not framing's), so say so.
        return (b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + tag
                + b"Content-Length: 1000\r\n\r\n"), True
    return b"HTTP/1.1 200 OK\r\n" + tag + b"Content-Length: 1000\r\n\r\n" + body[:5], True


class _ReplicaConnection(asyncio.Protocol):
    def __init__(self, replica: ScriptedReplica) -> None:
        self.replica = replica
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.replica.open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.replica.open.discard(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.replica.garbage += 1
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = bytearray()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        url = self.url.decode("latin-1")
        self.replica.arrivals.append(Arrival(method, url, bytes(self.body)))
        parts = url.split("/")
        assert self.transport is not None
        if len(parts) != 4 or parts[1] != "d" or parts[3] not in BEHAVIOURS:
            self.transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return
        data, close = reply(parts[2], parts[3], method == "HEAD")
        if data:
            self.transport.write(data)
        if close:
            self.transport.close()


class ScriptedReplica:
    def __init__(self) -> None:
        self.arrivals: list[Arrival] = []
        self.garbage = 0
        self.open: set[_ReplicaConnection] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _ReplicaConnection(self), HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        assert self.server is not None
        self.server.close()
        for conn in list(self.open):
            if conn.transport is not None:
                conn.transport.abort()
        await self.server.wait_closed()


@dataclass
class Bench:
    loop: asyncio.AbstractEventLoop
    replicas: list[ScriptedReplica]
    proxy: Proxy

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module", params=[1, 2], ids=["pool1", "pool2"])
def bench(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="replicas", daemon=True)
    thread.start()
    replicas = [ScriptedReplica(), ScriptedReplica()]
    proxies = ProxyFactory(tmp_path_factory.mktemp("proxy"))
    try:
        for r in replicas:
            asyncio.run_coroutine_threadsafe(r.start(), loop).result(10)
        proxy = proxies(*BASE_ARGS, "--pool-size", str(request.param), "--max-attempts", "1",
                        "--retry-deadline", "10", "--stream-idle-timeout", "5",
                        replicas=[f"http://{HOST}:{r.port}" for r in replicas])
        yield Bench(loop, replicas, proxy)
    finally:
        proxies.close()
        for r in replicas:
            asyncio.run_coroutine_threadsafe(r.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


# -- the model: what clients send --------------------------------------------------------------

_ids = itertools.count()


@dataclass
class Req:
    method: str
    behaviour: str
    body: bytes
    chunked: bool
    chunk_sizes: list[int]
    trailers: bool
    token: str | None
    absolute: bool
    expect: bool = False
    rid: str = ""

    @property
    def path(self) -> str:
        return f"/d/{self.rid}/{self.behaviour}"

    @property
    def head(self) -> bool:
        return self.method == "HEAD"

    @property
    def cuts(self) -> bool:
        """The proxy ends the client connection after (or during) this one's response."""
        return (self.behaviour == "cut" and not self.head) or self.token == "close"

    def wire(self) -> bytes:
        target = f"http://evil.example{self.path}" if self.absolute else self.path
        lines = [f"{self.method} {target} HTTP/1.1", "Host: proxy.test"]
        if self.token is not None:
            lines.append(f"Connection: {self.token}")
            if self.token == "x-hop":
                lines.append("X-Hop: dropped")
        if self.expect:
            lines.append("Expect: 100-continue")
        if self.chunked:
            lines.append("Transfer-Encoding: chunked")
        elif self.body:
            lines.append(f"Content-Length: {len(self.body)}")
        out = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if not self.chunked:
            return out + self.body
        pos = 0
        for size in self.chunk_sizes:
            piece = self.body[pos:pos + size]
            if piece:
                out += b"%x\r\n%s\r\n" % (len(piece), piece)
            pos += size
        if pos < len(self.body):
            out += b"%x\r\n%s\r\n" % (len(self.body) - pos, self.body[pos:])
        return out + (b"0\r\nX-Client-Trailer: t\r\n\r\n" if self.trailers else b"0\r\n\r\n")


@dataclass
class Refused:
    """A request the proxy must refuse itself (and then close): never forwarded."""
    wire: bytes
    status: int


@dataclass
class Batch:
    items: list[Req] | Refused
    splits: list[int] = field(default_factory=list)
    tail: Refused | None = None  # pipelined after the items: their answers may be lost


bodies = st.one_of(
    st.just(b""),
    st.binary(min_size=1, max_size=300),
    st.integers(1_000, 400_000).map(lambda n: bytes(range(256)) * (n // 256)),
    st.just(b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"),
)


@st.composite
def requests(draw: st.DrawFn) -> Req:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]))
    body = draw(bodies) if method in ("POST", "PUT") else b""
    chunked = method in ("POST", "PUT") and draw(st.booleans())
    return Req(
        method=method,
        behaviour=draw(st.sampled_from(BEHAVIOURS)),
        body=body,
        chunked=chunked,
        chunk_sizes=draw(st.lists(st.integers(1, 64), max_size=5)),
        trailers=chunked and draw(st.booleans()),
        token=draw(st.sampled_from([None, "keep-alive", "keep-alive, content-length",
                                    "transfer-encoding", "x-hop", "close"])),
        absolute=draw(st.booleans()),
        expect=bool(body) and draw(st.booleans()),
    )


refusals = st.sampled_from([
    Refused(b"GET /d/u/len HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
            b"Upgrade: websocket\r\n\r\n", 501),
    Refused(b"BLAH\x00 /x HTTP/1.1\r\n\r\n", 400),
    Refused(b"GET /d/nohost/len HTTP/1.1\r\n\r\n", 400),
    Refused(b"GET /d/twohosts/len HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    Refused(b"GET /d/badhost/len HTTP/1.1\r\nHost: a, b\r\n\r\n", 400),
    Refused(b"POST /d/both/len HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
])


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    if draw(st.integers(0, 9)) == 0:
        return Batch(draw(refusals))
    reqs = draw(st.lists(requests(), min_size=1, max_size=4))
    for i, req in enumerate(reqs):  # a request that ends the connection ends the batch
        if req.cuts:
            reqs = reqs[:i + 1]
            break
    tail = None
    if not reqs[-1].cuts and draw(st.integers(0, 9)) == 0:
        tail = draw(refusals)
    return Batch(reqs, draw(st.lists(st.integers(1, 400), max_size=3)), tail)


sessions = st.lists(st.lists(batches(), min_size=1, max_size=4), min_size=1, max_size=3)


# -- running one example -----------------------------------------------------------------------


@dataclass
class Outcome:
    sent: dict[str, Req] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


def check_response(req: Req, resp: rawhttp.Response, out: Outcome) -> None:
    rid = req.rid
    want_status = {"s204": 204, "s304": 304, "early": 502}.get(req.behaviour, 200)
    where = f"{req.method} {req.path} ({req.token}, absolute={req.absolute})"
    if resp.status != want_status:
        out.problems.append(f"{where}: status {resp.status}, body {resp.body[:80]!r}")
        return
    if want_status == 502:  # the proxy's own answer: framed, and nothing of a replica's
        if resp.names & {"x-req", "x-injected", "x-leak"} or (
                not req.head and b"bad_gateway" not in resp.body):
            out.problems.append(f"{where}: 502 is {resp.headers} {resp.body[:80]!r}")
        return
    if resp.all("X-Req") != [rid]:
        out.problems.append(f"{where}: answered with X-Req {resp.all('X-Req')}")
    names = resp.names
    if "x-injected" in names or INJECTED in resp.body:
        out.problems.append(f"{where}: a replica's extra response reached the client")
    if "x-leak" in names:
        out.problems.append(f"{where}: trailers leaked into the head")
    lengths = resp.all("Content-Length")
    chunked = [v for v in resp.all("Transfer-Encoding") if "chunked" in v.lower()]
    no_body = req.head or want_status in (204, 304)
    if len(lengths) > 1 or (lengths and chunked) or len(chunked) > 1:
        out.problems.append(f"{where}: framed twice: CL {lengths}, TE {chunked}")
    elif not no_body and not (lengths or chunked):
        out.problems.append(f"{where}: not framed ({resp.framing})")
    elif not no_body and resp.body != body_of(rid, req.behaviour):
        out.problems.append(f"{where}: body {resp.body[:80]!r}")
    out.answered.add(rid)


async def send_in_pieces(conn: rawhttp.RawConnection, data: bytes, splits: list[int]) -> None:
    """Send `data` cut at `splits`. The proxy may answer a refused tail (400) and close
    before the last piece is written: that reset ends the sending, and the responses
    already sent are read and checked as usual."""
    last = 0
    try:
        for cut in sorted({min(s, len(data)) for s in splits}):
            if cut > last:
                conn.send(data[last:cut])
                await conn.writer.drain()
                await asyncio.sleep(0)
                last = cut
        conn.send(data[last:])
        await conn.writer.drain()
    except (ConnectionResetError, BrokenPipeError):
        pass


async def run_client(port: int, client: int, session: list[Batch], out: Outcome) -> None:
    stack = contextlib.AsyncExitStack()
    conn: rawhttp.RawConnection | None = None
    async with stack:
        for batch in session:
            if conn is None:
                # Odd clients read through a small buffer: the proxy meets their backpressure.
                conn = await stack.enter_async_context(
                    rawhttp.connect(port, limit=4096 if client % 2 else 1 << 22))
            items = batch.items
            if isinstance(items, Refused):
                try:
                    resp = await conn.request(items.wire)
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    out.problems.append(f"refused {items.wire[:30]!r}: {exc!r}")
                else:
                    if resp.status != items.status:
                        out.problems.append(f"{items.wire[:30]!r}: {resp.status}, "
                                            f"want {items.status}")
                if not await conn.closed_by_peer(10):
                    out.problems.append(f"{items.wire[:30]!r}: connection left open")
                conn = None
                continue
            for req in items:
                req.rid = f"{client}.{next(_ids)}"
                out.sent[req.rid] = req
            tail = batch.tail.wire if batch.tail is not None else b""
            await send_in_pieces(conn, b"".join(r.wire() for r in items) + tail, batch.splits)
            for req in items:
                try:
                    resp = await conn.response(head=req.head)
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    if req.behaviour != "cut" and not tail:
                        out.problems.append(f"{req.method} {req.path}: {exc!r}")
                    conn = None
                    break
                if req.behaviour == "cut" and not req.head:
                    out.problems.append(f"{req.path}: a cut response arrived whole")
                check_response(req, resp, out)
            if conn is not None and tail:
                # The refusal's own answer may come or not (an abort drops it); then the end.
                if not await conn.closed_by_peer(10):
                    out.problems.append(f"{tail[:30]!r} after {len(items)}: left open")
                conn = None
            if conn is not None and items[-1].cuts:
                if not await conn.closed_by_peer(10):
                    out.problems.append(f"{items[-1].path}: connection left open")
                conn = None
        if conn is not None:  # still open: it must be reusable
            probe = Req("GET", "len", b"", False, [], False, None, False,
                        rid=f"{client}.{next(_ids)}")
            out.sent[probe.rid] = probe
            try:
                check_response(probe, await conn.request(probe.wire()), out)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                out.problems.append(f"probe: {exc!r}")


async def inflight(proxy: Proxy) -> int:
    status, body = await get_json(f"{proxy.admin_url}/snapshot")
    assert status == 200
    return sum(r["inflight"] for r in body["replicas"])


async def run_example(bench: Bench, session: list[list[Batch]]) -> Outcome:
    out = Outcome()
    before = [len(r.arrivals) for r in bench.replicas]
    garbage = sum(r.garbage for r in bench.replicas)
    async with asyncio.timeout(90):
        await asyncio.gather(*(run_client(bench.proxy.port, i, batches, out)
                               for i, batches in enumerate(session)))
        async def drained() -> bool:
            return await inflight(bench.proxy) == 0

        await until(drained, timeout=90, what="no request in flight at the proxy")
    if sum(r.garbage for r in bench.replicas) != garbage:
        out.problems.append("a replica received bytes it could not parse as HTTP")
    arrivals = [a for r, n in zip(bench.replicas, before, strict=True) for a in r.arrivals[n:]]
    seen: dict[str, int] = {}
    for a in arrivals:
        parts = a.url.split("/")
        rid = parts[2] if len(parts) == 4 and parts[1] == "d" else ""
        req = out.sent.get(rid)
        if req is None:
            out.problems.append(f"a request nobody sent reached a replica: {a}")
            continue
        seen[rid] = seen.get(rid, 0) + 1
        if (a.method, a.url, a.body) != (req.method, req.path, req.body):
            out.problems.append(f"forwarded as {a}, sent {req.method} {req.path} {req.body!r}")
    for rid, n in seen.items():
        if n > (2 if out.sent[rid].behaviour == "early" else 1):  # early: one stale retry
            out.problems.append(f"{out.sent[rid].path} reached replicas {n} times")
    for rid in out.answered - seen.keys():
        out.problems.append(f"{out.sent[rid].path} answered but never reached a replica")
    return out


# Large bodies are part of the model (data_too_large is suppressed for them). When an
# example fails, hypothesis replays it and warns if its repr passes 30 kB; pytest's
# filterwarnings = error raised that warning instead of the example's own failure, which
# it hid (CI, a 569 kB example).
LARGE_REPR = "ignore:Generating overly large repr:hypothesis.errors.HypothesisWarning"


@pytest.mark.filterwarnings(LARGE_REPR)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(session=sessions)
def test_request_path_matches_the_model(bench: Bench, session: list[list[Batch]]) -> None:
    out = bench.run(run_example(bench, session), timeout=120)
    assert not out.problems, "\n".join(out.problems)
