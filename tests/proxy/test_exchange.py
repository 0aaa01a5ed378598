"""The Exchange state machine (proxy/exchange.py), driven without sockets or an event loop.

An Exchange talks to its client, its pool and its upstream connection only through the
Protocols in proxy/interfaces.py. Here those three are test doubles of our own
interfaces (FakeClient, FakePool, FakeUpstream) that record what the Exchange asks of
them, and the test plays the other side: the pool handing out or failing a connection,
the replica's response events, the client going away, the sweeper's ticks. The ready
set, the policy, the config and the stats are the real ones; time is a FakeClock.

The whole path with real sockets is covered by test_framing.py, test_resilience.py and
test_differential.py; these tests pin the transitions one at a time. The doubles are
checked against the Protocols: `mypy --strict tests/proxy/test_exchange.py` is clean.
"""

from __future__ import annotations

import pytest

from proxy import http
from proxy.config import ProxyConfig
from proxy.errors import UpstreamConnectError
from proxy.exchange import DONE, SENT, STREAMING, WAIT_CONN, WAIT_REPLICA, Exchange
from proxy.failures import FailureLog
from proxy.interfaces import (
    PAUSE_BODY_BUFFER,
    ConnectionWaiter,
    ResponseSink,
    Upload,
    UpstreamLink,
)
from proxy.placement import Family
from proxy.readyset import ReadySet
from proxy.replica import Replica
from proxy.stats import Stats
from proxy.wire.snapshot import ReadyReplica, ReadySnapshot

URLS = ("http://127.0.0.1:9001", "http://127.0.0.1:9002")
TAIL = b"X-Forwarded-For: 10.0.0.1\r\n\r\n"  # what server.py forwards after Host


# -- test doubles of proxy/interfaces.py ----------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def time(self) -> float:
        return self.t


class FakeContext:
    """An ExchangeContext: the real config, ready set and stats; a fake clock."""

    def __init__(self, **config: object) -> None:
        self.config = ProxyConfig(**config)  # type: ignore[arg-type]
        self.loop = FakeClock()
        self.pools: dict[str, FakePool] = {}
        self.ready_set = ReadySet(pool_factory=self._pool)
        self.stats = Stats()
        self.draining = False
        self.access_log = None
        self.failures = FailureLog(None)

    @property
    def now(self) -> float:
        return self.loop.t

    def _pool(self, replica: Replica) -> FakePool:
        pool = self.pools[replica.url] = FakePool()
        return pool

    def advance(self, seconds: float) -> None:
        self.loop.t += seconds


class FakeUpstream:
    """An UpstreamLink that records what the Exchange sent and did to it."""

    def __init__(self) -> None:
        self.exchange: ResponseSink | None = None
        self.closed = False
        self.in_response = False
        self.body_framed = True
        self.reset = False
        self.served = 0
        self.paused = False
        self.sent: list[bytes] = []
        self.aborted = False

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    # The replica's side, as upstream.UpstreamConnection reports it to its exchange.

    def respond_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
        ex = self.exchange
        assert ex is not None, "no exchange is reading this connection"
        self.in_response = True
        return ex.on_response_headers(self, status, headers)

    def respond_body(self, data: bytes) -> None:
        ex = self.exchange
        assert ex is not None
        ex.on_response_body(data)
        ex.flush_client()  # the end of the read

    def respond_end(self, reusable: bool = True) -> None:
        ex = self.exchange
        assert ex is not None
        self.in_response = False
        self.exchange = None
        ex.on_response_complete(self, reusable)


class FakePool:
    """A ConnectionPool: hands out `idle` connections; otherwise the waiter is queued
    and the test decides (`connect` / `fail`)."""

    def __init__(self) -> None:
        self.idle: list[FakeUpstream] = []
        self.waiting: list[ConnectionWaiter] = []
        self.released: list[tuple[UpstreamLink, bool]] = []
        self.cancelled: list[ConnectionWaiter] = []
        self.acquired = 0

    def acquire(self, waiter: ConnectionWaiter) -> UpstreamLink | None:
        self.acquired += 1
        if self.idle:
            return self.idle.pop()
        self.waiting.append(waiter)
        return None

    def cancel(self, waiter: ConnectionWaiter) -> None:
        self.cancelled.append(waiter)

    def release(self, conn: UpstreamLink, reusable: bool) -> None:
        self.released.append((conn, reusable))

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass

    @property
    def size(self) -> int:
        return len(self.idle)

    def connect(self) -> FakeUpstream:
        """The connection the oldest waiter asked for is open (as ReplicaPool._connect)."""
        waiter = self.waiting.pop(0)
        conn = FakeUpstream()
        assert waiter.wants_connection(self)
        waiter.on_connection(conn)
        return conn

    def fail(self, error: str = "ConnectionRefusedError") -> None:
        waiter = self.waiting.pop(0)
        if waiter.wants_connection(self):
            waiter.on_connect_failed(UpstreamConnectError(error))


class FakeClient:
    """A ClientView that records writes, pauses and the end of its exchange."""

    def __init__(self, http11: bool = True) -> None:
        self.http11 = http11
        self.write_paused = False
        self.upload: Upload | None = None
        self.written: list[bytes] = []
        self.pause_mask = 0
        self.done: list[tuple[object, bool]] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def pause_reading_for(self, reason: int) -> None:
        self.pause_mask |= reason

    def resume_reading_for(self, reason: int) -> None:
        self.pause_mask &= ~reason

    def exchange_done(self, ex: object, close: bool) -> None:
        self.done.append((ex, close))

    def departed(self) -> bool:
        return False  # a fake client never leaves unseen

    def end_read(self) -> None:
        """What ClientConnection.data_received does once a read is parsed."""
        upload, self.upload = self.upload, None
        if upload is not None:
            upload.flush_upstream()

    def output(self) -> bytes:
        return b"".join(self.written)


# -- helpers ------------------------------------------------------------------------


def _ctx(*urls: str, **config: object) -> FakeContext:
    ctx = FakeContext(**config)
    ctx.ready_set.apply(ReadySnapshot(
        service="s", generation=1, published_at=0.0,
        replicas=tuple(ReadyReplica(id=i, url=u) for i, u in enumerate(urls))))
    return ctx


def _exchange(ctx: FakeContext, client: FakeClient, method: bytes = b"GET",
              *, has_body: bool = False) -> Exchange:
    return Exchange(ctx, client, method, method + b" /v1/x HTTP/1.1\r\n", TAIL,
                    keep_alive=True, chunked=False, started=ctx.loop.t, has_body=has_body)


def _replica(ctx: FakeContext, url: str) -> Replica:
    return ctx.ready_set.known[url]


def _idle(ctx: FakeContext, url: str) -> FakeUpstream:
    conn = FakeUpstream()
    ctx.pools[url].idle.append(conn)
    return conn


# -- tests ----------------------------------------------------------------------------


def test_request_with_body_goes_through_and_the_connection_is_released() -> None:
    ctx = _ctx(URLS[0])
    conn = _idle(ctx, URLS[0])
    client = FakeClient()
    ex = _exchange(ctx, client, b"POST", has_body=True)
    ex.start()
    # pick -> connection at once: the head goes out with the replica's Host.
    assert ex.state == SENT and conn.exchange is ex
    assert conn.sent == [b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:9001\r\n" + TAIL]
    assert _replica(ctx, URLS[0]).inflight == 1
    # Body chunks of one client read go upstream in one write, at the end of the read.
    ex.on_request_body(b"hel")
    ex.on_request_body(b"lo")
    assert conn.sent[1:] == []
    client.end_read()
    assert conn.sent[1:] == [b"hello"]
    ex.on_request_complete()
    # Response: nothing reaches the client before the read ends; then one write.
    assert conn.respond_head(200, [(b"Content-Length", b"2"), (b"Connection", b"keep-alive")]) \
        is False
    assert ex.state == STREAMING and client.written == []
    conn.respond_body(b"ok")
    assert client.output() == b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    conn.respond_end(reusable=True)
    assert ex.state == DONE
    assert ctx.pools[URLS[0]].released == [(conn, True)]
    assert conn.served == 1 and conn.exchange is None
    assert _replica(ctx, URLS[0]).inflight == 0
    assert client.done == [(ex, False)]
    assert ctx.stats.responses == {200: 1} and ctx.stats.attempts == 1


def test_body_not_finished_leaves_the_connection_unreusable() -> None:
    ctx = _ctx(URLS[0])
    conn = _idle(ctx, URLS[0])
    ex = _exchange(ctx, FakeClient(), b"POST", has_body=True)
    ex.start()
    ex.on_request_body(b"part")
    conn.respond_head(413, [(b"Content-Length", b"0")])
    conn.respond_end(reusable=True)  # the replica answered before the body ended
    assert ctx.pools[URLS[0]].released == [(conn, False)]


def test_connection_opened_later_gets_the_held_body() -> None:
    ctx = _ctx(URLS[0])
    client = FakeClient()
    ex = _exchange(ctx, client, b"POST", has_body=True)
    ex.start()
    assert ex.state == WAIT_CONN
    ex.on_request_body(b"abc")
    ex.on_request_complete()
    conn = ctx.pools[URLS[0]].connect()
    assert conn.sent == [b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:9001\r\n" + TAIL + b"abc"]
    assert ex.state == SENT


def test_connect_failure_retries_on_another_replica_within_the_deadline() -> None:
    ctx = _ctx(*URLS)
    client = FakeClient()
    ex = _exchange(ctx, client)
    ex.start()
    first, second = ctx.pools[URLS[0]], ctx.pools[URLS[1]]
    assert len(first.waiting) == 1 and second.acquired == 0
    _replica(ctx, URLS[1]).inflight += 1  # another request: least_load alone would pick 0
    ctx.advance(1.0)
    first.fail()
    # Retried at once on the replica not tried yet; the first is no longer held.
    assert ctx.stats.retries == 1 and ctx.stats.attempts == 2
    assert _replica(ctx, URLS[0]).inflight == 0 and _replica(ctx, URLS[1]).inflight == 2
    assert ex.state == WAIT_CONN and len(second.waiting) == 1
    conn = second.connect()
    conn.respond_head(200, [(b"Content-Length", b"0")])
    conn.respond_end()
    assert client.output() == b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    assert ctx.stats.responses == {200: 1}


def test_connect_failure_after_the_deadline_is_504_and_every_failure_502() -> None:
    ctx = _ctx(*URLS, retry_deadline=5.0)
    client = FakeClient()
    ex = _exchange(ctx, client)
    ex.start()
    ctx.advance(5.0)
    ctx.pools[URLS[0]].fail()
    assert client.output() == http.DEADLINE
    assert ctx.pools[URLS[1]].acquired == 0
    assert ex.state == DONE and _replica(ctx, URLS[0]).inflight == 0

    ctx = _ctx(*URLS, max_attempts=2)
    client = FakeClient()
    ex = _exchange(ctx, client)
    ex.start()
    ctx.pools[URLS[0]].fail()
    ctx.pools[URLS[1]].fail("TimeoutError")
    assert client.output() == http.bad_gateway("TimeoutError")
    assert ctx.stats.responses == {502: 1} and ctx.stats.attempts == 2


def test_nothing_ready_holds_then_answers_503_before_the_deadline() -> None:
    ctx = _ctx(empty_wait=3.0, retry_deadline=10.0)  # an empty set
    held: list[int] = []
    ctx.ready_set.set_hold_listener(lambda: held.append(1))
    client = FakeClient()
    ex = _exchange(ctx, client)
    ex.start()
    assert ex.state == WAIT_REPLICA and held == [1]
    ctx.advance(2.9)
    ex.tick(ctx.now)
    assert client.written == []  # still held
    ctx.advance(0.2)
    ex.tick(ctx.now)
    assert client.output() == http.NO_REPLICA
    assert ex.state == DONE and ctx.stats.responses == {503: 1}
    # Answered: a replica arriving now does not wake it.
    ctx.ready_set.apply(ReadySnapshot(service="s", generation=2, published_at=0.0,
                                      replicas=(ReadyReplica(id=0, url=URLS[0]),)))
    assert ctx.pools[URLS[0]].acquired == 0


def test_held_request_is_served_when_a_replica_arrives() -> None:
    ctx = _ctx()
    ex = _exchange(ctx, FakeClient())
    ex.start()
    assert ex.state == WAIT_REPLICA
    ctx.ready_set.apply(ReadySnapshot(service="s", generation=2, published_at=0.0,
                                      replicas=(ReadyReplica(id=0, url=URLS[0]),)))
    assert ex.state == WAIT_CONN and ctx.pools[URLS[0]].acquired == 1


def test_client_lost_mid_response_aborts_upstream_and_releases_the_replica() -> None:
    ctx = _ctx(URLS[0])
    conn = _idle(ctx, URLS[0])
    client = FakeClient()
    ex = _exchange(ctx, client)
    ex.start()
    ex.on_request_complete()
    conn.respond_head(200, [(b"Content-Type", b"text/event-stream")])
    conn.respond_body(b"data: 1\n\n")
    assert _replica(ctx, URLS[0]).inflight == 1
    ex.on_client_lost()
    assert conn.aborted and conn.exchange is None
    assert _replica(ctx, URLS[0]).inflight == 0
    assert ex.state == DONE and ctx.stats.responses == {499: 1}
    assert ctx.pools[URLS[0]].released == []  # aborted: never back to the pool
    ex.on_client_lost()  # once only
    assert ctx.stats.responses == {499: 1}


@pytest.mark.parametrize(("status", "last", "counted"), [
    (200, b"data: [DONE]\n\n", 200),  # the client read the stream's end, then closed
    (200, b"data: {}\n\ndata: [DONE]\r\n\r\n", 200),
    (200, b"data: [DONE]\n", 499),  # the event's blank line never came: not read as an end
    (200, b"data: 1\n\n", 499),  # mid-stream
    (200, b'data: {"text": "data: [DONE]\\n\\n"}\n\n', 499),  # the words, inside an event
    (500, b"data: [DONE]\n\n", 499),  # not a 200: never passed off as a whole answer
])
def test_a_client_closing_after_the_streams_done_event_is_not_a_499(
    status: int, last: bytes, counted: int,
) -> None:
    ctx = _ctx(URLS[0])
    conn = _idle(ctx, URLS[0])
    ex = _exchange(ctx, FakeClient())
    ex.start()
    ex.on_request_complete()
    conn.respond_head(status, [(b"Content-Type", b"text/event-stream")])
    conn.respond_body(b"data: 1\n\n")
    conn.respond_body(last)
    ex.on_client_lost()  # before the replica's last chunk
    assert ex.state == DONE and ex.status == counted
    assert ctx.stats.responses == {counted: 1}
    assert conn.aborted and _replica(ctx, URLS[0]).inflight == 0


def test_a_cold_prefill_is_counted_on_its_replica_until_the_first_response_byte() -> None:
    ctx = _ctx(URLS[0])
    conn = _idle(ctx, URLS[0])
    ex = _exchange(ctx, FakeClient())
    replica = _replica(ctx, URLS[0])
    family = Family(replica, 0.0)
    family.warming = replica  # the first request of its new spill replica
    ex.cold, ex.warms = True, family  # as the prefix policy marks a predicted miss
    ex.body_len = 3000  # the policy picks once it has the body (the prompt) in
    ex.start()
    ex.on_request_complete()
    assert replica.prefilling == 1 and replica.prefill_bytes == 3000
    conn.respond_head(200, [(b"Content-Type", b"text/event-stream")])
    assert replica.prefilling == 1 and family.warming is replica  # a head may come first
    conn.respond_body(b"data: 1\n\n")
    assert replica.prefilling == 0 and replica.prefill_bytes == 0 and replica.inflight == 1
    assert family.warming is None and ex.warms is None  # it has the prompt now
    conn.respond_body(b"data: 2\n\n")
    conn.respond_end()
    assert replica.prefilling == 0 and replica.inflight == 0


@pytest.mark.parametrize("ending", ["client_lost", "connect_failed", "deadline", "reset"])
def test_a_cold_prefill_that_never_answered_is_uncounted(ending: str) -> None:
    ctx = _ctx(URLS[0], retry_deadline=5.0, max_attempts=1)
    pool_conn = _idle(ctx, URLS[0]) if ending in ("client_lost", "reset") else None
    ex = _exchange(ctx, FakeClient())
    replica = _replica(ctx, URLS[0])
    family = Family(replica, 0.0)
    family.warming = replica
    ex.cold, ex.warms = True, family
    ex.body_len = 3000
    ex.start()
    ex.on_request_complete()
    assert replica.prefilling == 1 and replica.prefill_bytes == 3000
    if ending == "client_lost":
        ex.on_client_lost()
    elif ending == "connect_failed":
        ex.on_connect_failed(UpstreamConnectError("refused"))
    elif ending == "deadline":
        ctx.advance(6.0)
        ex.tick(ctx.now)
    else:
        assert pool_conn is not None
        pool_conn.reset = True
        ex.on_upstream_lost(pool_conn, in_response=False)
    assert ex.state == DONE
    assert replica.prefilling == 0 and replica.prefill_bytes == 0 and replica.inflight == 0
    assert family.warming is None  # it never will have the prompt: the overflow may go there


def test_client_lost_while_waiting_for_a_connection_leaves_the_pool_queue() -> None:
    ctx = _ctx(URLS[0])
    ex = _exchange(ctx, FakeClient())
    ex.start()
    pool = ctx.pools[URLS[0]]
    ex.on_client_lost()
    assert pool.cancelled == [ex] and not ex.wants_connection(pool)
    assert _replica(ctx, URLS[0]).inflight == 0


def test_head_response_ends_at_its_headers() -> None:
    ctx = _ctx(URLS[0])
    conn = _idle(ctx, URLS[0])
    client = FakeClient()
    ex = _exchange(ctx, client, b"HEAD")
    ex.start()
    ex.on_request_complete()
    # Content-Length describes the GET's body: kept, and no body follows.
    assert conn.respond_head(200, [(b"Content-Length", b"10")]) is True
    conn.respond_end()
    assert client.output() == b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"
    assert conn.body_framed


def test_head_gets_no_body_in_a_proxy_generated_answer() -> None:
    ctx = _ctx(empty_wait=1.0)
    client = FakeClient()
    ex = _exchange(ctx, client, b"HEAD")
    ex.start()
    ctx.advance(1.0)
    ex.tick(ctx.now)
    out = client.output()
    assert out.startswith(b"HTTP/1.1 503 ") and out.endswith(b"\r\n\r\n")
    assert out == http.NO_REPLICA[:http.NO_REPLICA.index(b"\r\n\r\n") + 4]


def test_204_adds_no_framing_while_an_unframed_200_is_rechunked() -> None:
    ctx = _ctx(URLS[0])
    conn = _idle(ctx, URLS[0])
    client = FakeClient()
    ex = _exchange(ctx, client)
    ex.start()
    ex.on_request_complete()
    assert conn.respond_head(204, [(b"X-A", b"1")]) is False
    conn.respond_end()
    assert client.output() == b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n"
    assert conn.body_framed  # a 204 has no body: not read until close

    conn = _idle(ctx, URLS[0])
    client = FakeClient()
    ex = _exchange(ctx, client)
    ex.start()
    ex.on_request_complete()
    conn.respond_head(200, [(b"X-A", b"1")])  # no length: the body ends at close
    assert not conn.body_framed
    conn.respond_body(b"abc")
    conn.respond_end(reusable=False)
    assert client.output() == (b"HTTP/1.1 200 OK\r\nX-A: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
                               b"3\r\nabc\r\n0\r\n\r\n")


def test_body_buffer_pauses_the_client_until_a_connection_takes_it() -> None:
    ctx = _ctx(URLS[0])
    client = FakeClient()
    ex = _exchange(ctx, client, b"POST", has_body=True)
    ex.start()
    ex.on_request_body(b"x" * (256 * 1024 + 1))  # past the high-water mark, no connection
    assert client.pause_mask & PAUSE_BODY_BUFFER
    ctx.pools[URLS[0]].connect()
    assert not client.pause_mask & PAUSE_BODY_BUFFER


def test_stale_pooled_connection_gets_one_free_attempt() -> None:
    ctx = _ctx(URLS[0], max_attempts=1)
    stale = _idle(ctx, URLS[0])
    stale.served = 1  # a kept-alive connection the replica closed meanwhile
    client = FakeClient()
    ex = _exchange(ctx, client)
    ex.start()
    stale.exchange = None  # as UpstreamConnection.connection_lost reports it
    ex.on_upstream_lost(stale, False)
    # Retried although max_attempts is 1: nothing was sent to the client.
    pool = ctx.pools[URLS[0]]
    assert client.written == [] and pool.acquired == 2 and ex.state == WAIT_CONN
    fresh = pool.connect()
    fresh.exchange = None
    ex.on_upstream_lost(fresh, False)  # a fresh connection lost: no second free attempt
    assert client.output() == http.bad_gateway("UpstreamResetError")
    assert _replica(ctx, URLS[0]).inflight == 0
