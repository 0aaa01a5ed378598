"""Exchange: one request from arrival to the end of its response (the request's state machine).

The client connection (server.py) parses a request head and creates an
Exchange, which picks a replica from the ready set, takes a pooled connection,
writes the request head and body in one write, and relays the response back
chunk by chunk. The common path (a replica and an idle connection available at
once) runs entirely in callbacks: no Task, no Future, no logging, no timer
object. The Exchange sees its client, pool and upstream connection only
through proxy/interfaces.py.

States, in order: NEW (head read; maybe holding the body's first bytes for the
policy), WAIT_REPLICA (held for a ready replica), WAIT_CONN (waiting for a pool
connection), SENT (request on the wire, no response head yet), STREAMING
(response head relayed), DONE.

Timeouts are enforced by the connection's sweeper (`ServerContext.tick`, every
100 ms, calling `Exchange.tick`), which looks at absolute deadlines and progress
counters instead of a timer per request: the request deadline (until response
headers; time spent uploading the body to a replica does not count), the wait
for a ready replica, and the idle time between response chunks and between
request-body chunks (408).

Retries: only before anything was sent to the client, only while the request
body is still held in full (bodies up to `retry_body_limit` are kept), up to
`max_attempts`, each on a replica not yet tried when one exists. A pooled
connection that turns out stale (closed before any response byte) gets one
extra attempt that does not count against `max_attempts`.

This module is over the ~400-line target on purpose: the Exchange is one state
machine whose transitions read best side by side, and splitting its methods over
modules (mixins) would scatter one object's state without making any part simpler.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from proxy import http
from proxy.cuts import record_cut
from proxy.failures import FailureLog
from proxy.interfaces import (
    PAUSE_BODY_BUFFER,
    PAUSE_UPSTREAM,
    ClientView,
    ConnectionPool,
    ReplicaView,
    UpstreamLink,
    Warming,
)
from proxy.outcomes import MARKER, NO_REPORT, SCAN_FROM, cached_tokens, record

if TYPE_CHECKING:
    from proxy.accesslog import AccessLog
    from proxy.config import ProxyConfig
    from proxy.readyset import ReadySet
    from proxy.stats import Stats
    from proxy.warmup import Warmer

# Exchange states, in order.
NEW, WAIT_REPLICA, WAIT_CONN, SENT, STREAMING, DONE = range(6)

_BODY_BUFFER_HIGH = 256 * 1024
_ROUTE_WAIT = 1.0  # longest a request waits for the body bytes its policy routes on
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
# The last event of an OpenAI-style stream, blank line included (the client has read it).
_DONE_EVENTS = (b"data: [DONE]\n\n", b"data: [DONE]\r\n\r\n", b"data:[DONE]\n\n")


class Clock(Protocol):
    def time(self) -> float: ...


class ExchangeContext(Protocol):
    """What an Exchange reads of its process (server.ServerContext)."""

    @property
    def config(self) -> ProxyConfig: ...

    @property
    def ready_set(self) -> ReadySet: ...

    @property
    def stats(self) -> Stats: ...

    @property
    def loop(self) -> Clock: ...  # loop.time(): the exact clock

    @property
    def now(self) -> float: ...  # the coarse clock, advanced by the sweeper

    @property
    def draining(self) -> bool: ...

    @property
    def access_log(self) -> AccessLog | None: ...  # --access-log (None: off)

    @property
    def failures(self) -> FailureLog: ...  # the rate-limited 502/503/504 warnings

    @property
    def warmer(self) -> Warmer: ...  # sends the prefix policy's warm-ups (proxy/warmup.py)


class Exchange:
    """One request from arrival to the end of its response."""

    __slots__ = (
        "attempts",
        "awaiting_body",
        "body",
        "body_done",
        "body_len",
        "body_whole",
        "cached",
        "chunked",
        "client",
        "close_after",
        "cold",
        "ctx",
        "cut_cause",
        "deadline_at",
        "discard_body",
        "empty_until",
        "failed_on",
        "has_body",
        "head_line",
        "head_tail",
        "heartbeat_at",
        "is_head",
        "last_chunk",
        "last_error",
        "out",
        "outcome",
        "pool",
        "prefill_len",
        "prefill_on",
        "prewarm",
        "progress",
        "progress_at",
        "refused",
        "replica",
        "req_headers",
        "resp_bytes",
        "resp_chunked",
        "route_key",
        "seen_progress",
        "sse_held",
        "stale_retry_used",
        "started",
        "state",
        "status",
        "tried",
        "up_out",
        "upload_at",
        "upstream",
        "warms",
    )

    def __init__(self, ctx: ExchangeContext, client: ClientView, method: bytes,
                 head_line: bytes, head_tail: bytes, *, keep_alive: bool, chunked: bool,
                 started: float, has_body: bool = False) -> None:
        # -- where it runs
        self.ctx = ctx
        self.client = client
        self.state = NEW
        # -- the request as the replica will get it
        self.head_line = head_line
        self.head_tail = head_tail
        self.chunked = chunked  # the request body is chunked (re-chunked as received)
        self.is_head = method == b"HEAD"
        self.has_body = has_body
        self.req_headers: list[tuple[bytes, bytes]] = []  # read by routing policies
        self.route_key: tuple[int, ...] | None = None  # computed by the prefix policy
        # The prefix policy's counters for its prediction (proxy/outcomes.py; None: not
        # prefix-routed, the response is not scanned) and the engine's report (-1: none).
        self.outcome: list[int] | None = None
        self.cached = NO_REPORT
        self.cold = False  # the prefix policy predicted a miss (a cold prefill)
        self.prefill_on: ReplicaView | None = None  # counted in its `prefilling` until then
        self.prefill_len = 0  # the body bytes counted in its `prefill_bytes` meanwhile
        self.warms: Warming | None = None  # a family whose new spill replica it prefills
        # A replica the prefix policy wants warmed up with this prompt, and its callback.
        self.prewarm: tuple[ReplicaView, Callable[[bool], None]] | None = None
        self.awaiting_body = False  # holding the body's first bytes before choosing
        # -- the request body
        self.body: list[bytes] = []  # held for a retry (or before a replica is chosen)
        self.body_len = 0
        self.body_done = False
        self.body_whole = True  # every body byte received so far is still held
        self.up_out: list[bytes] = []  # request body bytes not yet written upstream
        self.upload_at = 0.0  # > 0 while the body streams to a replica: when that began
        # -- time: absolute deadlines, checked by tick()
        self.started = started
        self.deadline_at = started + ctx.config.retry_deadline
        self.empty_until = 0.0  # while held for a replica: answer 503 then
        self.heartbeat_at = 0.0  # while held: next SSE heartbeat (--hold-heartbeat)
        self.progress = 0  # body chunks seen (either direction); tick() compares
        self.seen_progress = 0
        self.progress_at = 0.0
        # -- the attempt: replica, pool, connection, retries
        self.replica: ReplicaView | None = None
        self.pool: ConnectionPool | None = None
        self.upstream: UpstreamLink | None = None
        self.attempts = 0
        self.tried: set[ReplicaView] | None = None
        self.refused: set[ReplicaView] | None = None  # tried, and no connection was made
        self.stale_retry_used = False
        self.last_error = "none"
        self.failed_on: str | None = None  # the replica of the last failed attempt
        # -- the response relayed to the client
        self.status = 0
        self.resp_bytes = 0  # response body bytes relayed (for a cut's log line)
        self.last_chunk = b""  # the last body chunk relayed (did the stream end? on_client_lost)
        self.cut_cause: str | None = None  # why the response was cut short (proxy/cuts.py)
        self.out: list[bytes] = []  # response bytes not yet written to the client
        self.resp_chunked = False  # we chunk the body for the client
        self.close_after = not keep_alive  # close the client connection after this response
        self.sse_held = False  # our own 200 event-stream head went out while held
        self.discard_body = False  # the held stream ended with an error event: drop the body

    # -- choosing a replica and a connection ------------------------------------

    def start(self) -> None:
        ctx = self.ctx
        ctx.stats.requests_total += 1
        if ctx.draining:
            self.close_after = True  # served, but the connection closes after it
        need = ctx.ready_set.policy.body_prefix
        if need and self.has_body and not self.body_done and self.body_len < need:
            # The policy routes on the body's first bytes: choose once they are here
            # (on_request_body, on_request_complete, or tick after _ROUTE_WAIT).
            self.awaiting_body = True
            return
        self.pick()

    def route_now(self) -> None:
        self.awaiting_body = False
        if self.state == NEW:  # not answered meanwhile (413, client gone)
            self.pick()

    def pick(self) -> None:
        ready_set = self.ctx.ready_set
        replica = ready_set.choose(self.tried, self)
        if replica is None:
            if ready_set.replicas:
                # Every replica tried: reuse one, one that took a connection if any did (a
                # replica that refused is likely dead, and the least loaded for being so).
                refused = self.refused
                if refused is not None:
                    replica = ready_set.choose(refused, self)
                if replica is None:
                    replica = ready_set.choose(None, self)
            if replica is None:
                cfg = self.ctx.config
                stats = self.ctx.stats
                if (stats.held >= cfg.max_held
                        or stats.held_bytes + self.body_len > cfg.max_held_bytes):
                    self.refuse_hold()
                    return
                stats.held += 1
                stats.held_bytes += self.body_len
                self.state = WAIT_REPLICA
                self.empty_until = min(self.ctx.now + cfg.empty_wait, self.deadline_at)
                if cfg.hold_heartbeat and not self.heartbeat_at:
                    self.heartbeat_at = self.ctx.now + cfg.hold_heartbeat
                ready_set.add_waiter(self.wake)
                return
        if self.prewarm is not None:
            self.send_prewarm()
        self.replica = replica
        replica.inflight += 1
        if self.cold:
            replica.prefilling += 1
            replica.prefill_bytes += self.body_len
            self.prefill_len = self.body_len
            self.prefill_on = replica
        self.attempts += 1
        self.ctx.stats.attempts += 1
        pool: ConnectionPool = replica.pool  # type: ignore[assignment]
        self.pool = pool
        self.state = WAIT_CONN
        conn = pool.acquire(self)
        if conn is not None:
            self.on_connection(conn)

    def send_prewarm(self) -> None:
        """Hand the prefix policy's warm-up to the Warmer, with the body (complete: the
        policy asks only then); one no longer held whole (past --retry-body-limit) is not
        warmed: the callback hears False at once."""
        target, done = self.prewarm  # type: ignore[misc]
        self.prewarm = None
        if self.body_whole:
            body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
            self.ctx.warmer.start(target, self.head_line, self.head_tail, body, done)
        else:
            done(False)

    def wake(self) -> None:
        if self.state == WAIT_REPLICA:
            if self.client.departed():  # its FIN was never read (reading paused)
                self.on_client_lost()
                return
            self.unhold()
            self.state = NEW  # not held while choosing again (a refusal must not unhold)
            self.pick()

    def unhold(self) -> None:
        stats = self.ctx.stats
        stats.held -= 1
        stats.held_bytes -= self.body_len

    def refuse_hold(self) -> None:
        """Past --max-held or --max-held-bytes: a fast 503 instead of holding (counted)."""
        self.ctx.stats.held_refused += 1
        if self.body_done:
            self.fail(http.HOLD_FULL, 503, "overloaded (--max-held, --max-held-bytes)")
        else:  # the rest of the body is still coming: close rather than read it
            self.fail(http.HOLD_FULL_CLOSE, 503, "overloaded (--max-held, --max-held-bytes)",
                      close=True)

    def wants_connection(self, pool: ConnectionPool) -> bool:
        return self.state == WAIT_CONN and self.pool is pool

    def on_connection(self, conn: UpstreamLink) -> None:
        self.upstream = conn
        conn.exchange = self
        conn.in_response = False
        conn.body_framed = True
        self.state = SENT
        replica: ReplicaView = self.replica  # type: ignore[assignment]
        head_line = self.head_line
        if replica.path:  # "GET /v1/x HTTP/1.1" -> "GET /prefix/v1/x HTTP/1.1"
            head_line = head_line.replace(b" ", b" " + replica.path, 1)
        parts = [head_line, b"Host: ", replica.host_header, http.CRLF, self.head_tail]
        if self.chunked:
            parts.extend(http.chunk(b) for b in self.body if b)
            if self.body_done:
                parts.append(http.LAST_CHUNK)
        else:
            parts.extend(self.body)
        if self.client.write_paused:
            conn.pause_reading()  # the client is not taking what it was already sent
        elif conn.paused:
            conn.resume_reading()  # paused by a previous exchange's slow client
        conn.send(b"".join(parts))
        if not self.body_done:
            self.upload_at = self.progress_at = self.ctx.now
        if self.body_len > self.ctx.config.retry_body_limit:
            self.body_whole = False
            self.body.clear()
        self.client.resume_reading_for(PAUSE_BODY_BUFFER)

    def on_connect_failed(self, error: Exception) -> None:
        self.last_error = str(error) or type(error).__name__
        replica = self.replica
        if replica is not None:
            if self.refused is None:
                self.refused = {replica}
            else:
                self.refused.add(replica)
        self.release_replica()
        self.retry_or_fail(free=False)

    # -- the request body -----------------------------------------------------------

    def on_request_body(self, data: bytes) -> None:
        if self.state == DONE:
            return  # the replica answered early; the rest of the body is discarded
        self.body_len += len(data)
        cfg = self.ctx.config
        if self.state == WAIT_REPLICA:
            stats = self.ctx.stats
            stats.held_bytes += len(data)
            if stats.held_bytes > cfg.max_held_bytes:
                self.refuse_hold()
                return
        if self.body_len > cfg.max_body:
            if self.state < STREAMING:
                self.respond(http.TOO_LARGE, 413, close=True)
            else:
                self.cut("request_too_large")
            return
        self.progress += 1
        conn = self.upstream
        if conn is not None:
            # Sent once at the end of the client's read (many small chunks: one write).
            up_out = self.up_out
            if self.chunked:
                up_out.append(b"%x\r\n" % len(data))
                up_out.append(data)
                up_out.append(http.CRLF)
            else:
                up_out.append(data)
            self.upload_at_read_end()
            if self.body_whole:
                if self.body_len <= cfg.retry_body_limit:
                    self.body.append(data)
                else:
                    # Too large to keep for a retry: this request can no longer be retried.
                    self.body_whole = False
                    self.body.clear()
        else:
            # Not sent anywhere yet: hold it all (reading pauses past the high-water mark).
            self.body.append(data)
            if self.body_len > _BODY_BUFFER_HIGH:
                self.client.pause_reading_for(PAUSE_BODY_BUFFER)
            if self.awaiting_body and self.body_len >= self.ctx.ready_set.policy.body_prefix:
                self.route_now()

    def on_request_complete(self) -> None:
        self.body_done = True
        if self.awaiting_body:
            self.route_now()  # sends the whole body, with the last chunk, once connected
            return
        conn = self.upstream
        if conn is not None:
            if self.chunked:
                self.up_out.append(http.LAST_CHUNK)
                self.upload_at_read_end()
            if self.upload_at:
                # The time the client spent sending the body to the replica does not count
                # against the deadline (which bounds waiting for a replica and for headers).
                self.deadline_at += self.ctx.now - self.upload_at
                self.upload_at = 0.0

    def upload_at_read_end(self) -> None:
        """Have `up_out` written when the client's read has been parsed (one write per read)."""
        client = self.client
        waiting = client.upload
        if waiting is not self:
            if waiting is not None:
                waiting.flush_upstream()  # another exchange's bytes go first, as received
            client.upload = self

    def flush_upstream(self) -> None:
        up_out = self.up_out
        conn = self.upstream
        if up_out:
            if conn is not None:
                conn.send(up_out[0] if len(up_out) == 1 else b"".join(up_out))
            up_out.clear()

    # -- the response ---------------------------------------------------------------

    def on_response_headers(self, conn: UpstreamLink, status: int,
                            headers: list[tuple[bytes, bytes]]) -> bool:
        """Relay the response head; True when no body follows (a HEAD request)."""
        ctx = self.ctx
        if (status >= 500 and self.replica is not None
                and self.replica.left_at is not None and self.can_retry()):
            # A replica that is leaving the set answers 5xx: try another one instead.
            self.last_error = f"HTTP {status} from a leaving replica"
            self.detach_upstream(abort=True)
            self.release_replica()
            self.retry_or_fail(free=False)
            return False
        self.state = STREAMING
        self.status = status
        ctx.stats.ttfb.observe(ctx.loop.time() - self.started)
        if self.sse_held:
            return self._continue_held_stream(conn, status, headers)
        self.out.append(self._response_head(conn, status, headers))
        self.progress_at = ctx.now
        return self.is_head

    def _response_head(self, conn: UpstreamLink, status: int,
                       headers: list[tuple[bytes, bytes]]) -> bytes:
        """The head relayed to the client: hop-by-hop headers dropped, framing re-decided."""
        out = [http.status_line(status)]
        hop = http.HOP_BY_HOP
        length = False
        chunked = False
        connection: bytes | None = None  # the Connection values, comma-joined
        for name, value in headers:
            lname = name.lower()
            if lname in hop:
                if lname == b"transfer-encoding":
                    chunked = True
                elif lname == b"connection":
                    connection = value if connection is None else connection + b"," + value
                continue
            if lname == b"content-length":
                length = True
            out.append(b"%s: %s\r\n" % (name, value))
        if connection is not None:
            out = http.drop_named_hop(out, connection, 1)  # out[0] is the status line
        no_body = self.is_head or status == 204 or status == 304
        if not no_body and not length:
            if not chunked:
                conn.body_framed = False  # ends when the replica closes
            if self.client.http11:
                out.append(b"Transfer-Encoding: chunked\r\n")
                self.resp_chunked = True
            else:
                self.close_after = True  # HTTP/1.0 client: delimit by closing
        elif self.is_head and chunked:
            out.append(b"Transfer-Encoding: chunked\r\n")
        if self.close_after or self.ctx.draining:
            self.close_after = True
            out.append(b"Connection: close\r\n")
        elif not self.client.http11:
            out.append(b"Connection: keep-alive\r\n")
        out.append(http.CRLF)
        return b"".join(out)

    def _continue_held_stream(self, conn: UpstreamLink, status: int,
                              headers: list[tuple[bytes, bytes]]) -> bool:
        """The client already has our 200 event-stream head: relay only the body."""
        if status != 200:
            self.out.append(http.chunk(http.sse_error(status, "upstream_status")))
            self.close_after = True
            self.discard_body = True
        names = {name.lower() for name, _ in headers}
        if b"content-length" not in names and b"transfer-encoding" not in names:
            conn.body_framed = False
        self.progress_at = self.ctx.now
        return False

    def heartbeat(self, now: float) -> None:
        """Held past --hold-heartbeat: start (or continue) the SSE heartbeat stream."""
        every = self.ctx.config.hold_heartbeat
        self.heartbeat_at = now + every
        if self.sse_held:
            self.client.write(http.chunk(http.SSE_HEARTBEAT))
            return
        # Only a complete `"stream": true` body from an HTTP/1.1 client (rare path: the
        # body was held in full, and this runs once per held request).
        # Never for HEAD: a body on a HEAD response desynchronises whoever reads it.
        if self.is_head or not (self.body_done and self.body_whole and self.client.http11
                                and _STREAM_TRUE.search(b"".join(self.body))):
            self.heartbeat_at = float("inf")
            return
        self.sse_held = True
        self.resp_chunked = True
        self.client.write(http.SSE_HOLD_HEAD + http.chunk(http.SSE_HEARTBEAT))

    def on_response_body(self, data: bytes) -> None:
        self.progress += 1
        self.resp_bytes += len(data)
        if self.discard_body:
            return
        # The engine's report of cached prompt tokens (prefix policy only; proxy/outcomes.py).
        if self.outcome is not None and data.find(MARKER, SCAN_FROM) >= 0:
            self.cached = cached_tokens(data, self.cached)
        self.last_chunk = data
        if self.prefill_on is not None:
            self.prefilled()
        if self.resp_chunked:
            self.out.append(b"%x\r\n" % len(data))
            self.out.append(data)
            self.out.append(http.CRLF)
        else:
            self.out.append(data)

    def flush_client(self) -> None:
        out = self.out
        if out:
            self.client.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def on_response_complete(self, conn: UpstreamLink, reusable: bool) -> None:
        if self.resp_chunked:
            self.out.append(http.LAST_CHUNK)
        self.flush_client()
        conn.served += 1
        self.upstream = None
        pool: ConnectionPool = self.pool  # type: ignore[assignment]
        # A request body not fully sent leaves the connection mid-message: not reusable.
        pool.release(conn, reusable and self.body_done)
        stats = self.ctx.stats
        stats.upstream_latency.observe(self.ctx.loop.time() - self.started)
        stats.count_response(self.status)
        if self.outcome is not None and self.cached >= 0:
            record(self.outcome, self.cached)
        self.finish(self.close_after)

    def on_upstream_error(self, error: str) -> None:
        """The replica broke a limit (oversized headers or trailers): 502, or cut if started."""
        if self.state == STREAMING:
            self.cut("upstream_error")
        else:
            self.last_error = error
            self.fail(http.bad_gateway(error), 502, error)

    def on_upstream_lost(self, conn: UpstreamLink, in_response: bool) -> None:
        self.upstream = None
        if self.state == STREAMING or in_response:
            # Cut after the first byte: never retried; end the client's stream visibly.
            self.flush_client()
            self.record_cut("upstream_reset" if conn.reset else "upstream_eof")
            self.finish(True)
            return
        self.last_error = "UpstreamResetError"  # the name clients see in the 502 detail
        free = conn.served > 0 and not self.stale_retry_used
        self.release_replica(tried=not free)
        self.retry_or_fail(free=free)

    # -- endings ----------------------------------------------------------------

    def can_retry(self) -> bool:
        return (self.body_whole and self.ctx.loop.time() < self.deadline_at
                and self.attempts < self.ctx.config.max_attempts)

    def retry_or_fail(self, free: bool) -> None:
        if self.state == DONE:
            return
        if free:
            self.stale_retry_used = True
            self.attempts -= 1
        if self.can_retry():
            self.ctx.stats.retries += 1
            self.pick()
        elif self.ctx.loop.time() >= self.deadline_at:
            self.fail(http.DEADLINE, 504, f"deadline_exceeded; last error: {self.last_error}")
        else:
            self.fail(http.bad_gateway(self.last_error), 502, self.last_error)

    def prefilled(self) -> None:
        """The cold prefill is over (its first response byte came) or abandoned."""
        replica: ReplicaView = self.prefill_on  # type: ignore[assignment]
        replica.prefilling -= 1
        replica.prefill_bytes -= self.prefill_len
        self.prefill_on = None
        family = self.warms
        if family is not None:  # the family's spill replica has its prompt (or never will)
            self.warms = None
            if family.warming is replica:
                family.warming = None

    def release_replica(self, tried: bool = True) -> None:
        if self.prefill_on is not None:
            self.prefilled()
        replica = self.replica
        if replica is not None:
            self.replica = None
            replica.inflight -= 1
            if tried:
                self.failed_on = replica.url
                if self.tried is None:
                    self.tried = {replica}
                else:
                    self.tried.add(replica)

    def detach_upstream(self, abort: bool) -> None:
        conn = self.upstream
        if conn is not None:
            self.upstream = None
            conn.exchange = None
            if abort:
                conn.abort()
        if self.state == WAIT_CONN and self.pool is not None:
            self.pool.cancel(self)
        elif self.state == WAIT_REPLICA:
            self.ctx.ready_set.remove_waiter(self.wake)
            self.unhold()

    def fail(self, response: bytes, status: int, cause: str, close: bool = False) -> None:
        """Answer a 502/503/504 of our own, logged rate-limited (proxy/failures.py)."""
        replica = self.replica
        self.ctx.failures.record(
            self.ctx.now, replica=replica.url if replica is not None else self.failed_on,
            status=status, cause=cause, head_line=self.head_line, attempts=self.attempts)
        self.respond(response, status, close)

    def respond(self, response: bytes, status: int, close: bool = False) -> None:
        """Answer with a proxy-generated response; only before any response byte was sent."""
        self.detach_upstream(abort=True)
        self.release_replica()
        if self.sse_held:
            # Our 200 head is out: end the event stream with an error event instead.
            response = http.chunk(http.sse_error(status)) + http.LAST_CHUNK
        elif self.is_head:
            response = response[:response.index(b"\r\n\r\n") + 4]  # no body, ever, for HEAD
        self.client.write(response)
        self.ctx.stats.count_response(status)
        self.status = status
        self.finish(close or self.close_after)

    def cut(self, cause: str = "unknown") -> None:
        """End a response that already started: the client sees the connection close."""
        self.detach_upstream(abort=True)
        self.flush_client()
        self.record_cut(cause)
        self.finish(True)

    def record_cut(self, cause: str) -> None:
        """Count and log a response cut short (proxy/cuts.py); before `finish`, which
        forgets the replica."""
        ctx = self.ctx
        replica = self.replica
        self.cut_cause = cause
        record_cut(ctx.stats, cause, service=ctx.config.service,
                   replica=replica.url if replica is not None else "-",
                   head_line=self.head_line, sent=self.resp_bytes,
                   seconds=ctx.loop.time() - self.started, status=self.status)

    def finish(self, close: bool) -> None:
        if self.state == DONE:
            return
        self.state = DONE
        if self.ctx.access_log is not None:
            self.log_access()
        self.release_replica(tried=False)
        self.client.resume_reading_for(PAUSE_BODY_BUFFER | PAUSE_UPSTREAM)
        self.client.exchange_done(self, close)

    def log_access(self) -> None:
        """One access-log line (--access-log; proxy/accesslog.py); before the replica
        is forgotten."""
        ctx = self.ctx
        replica = self.replica
        ctx.access_log.record(  # type: ignore[union-attr]
            self.client.peer, self.head_line, self.req_headers, self.status, self.resp_bytes,
            ctx.loop.time() - self.started, replica.url if replica is not None else None,
            self.cut_cause)  # fmt: skip

    def on_client_lost(self) -> None:
        """The client went away: cancel the upstream request at once (499).

        Not a 499 when the client closed after the stream's `data: [DONE]` event, before
        the response's last chunk came from the replica: it has its whole answer (many
        SSE readers close on [DONE]), so the response counts as the status it had.
        """
        if self.state == DONE:
            return
        self.detach_upstream(abort=True)
        whole = (self.state == STREAMING and self.status == 200 and not self.discard_body
                 and self.last_chunk.endswith(_DONE_EVENTS))
        self.state = DONE
        if not whole:
            self.status = 499
        elif self.outcome is not None and self.cached >= 0:
            record(self.outcome, self.cached)
        if self.ctx.access_log is not None:
            self.log_access()
        self.release_replica(tried=False)
        self.ctx.stats.count_response(self.status)

    def tick(self, now: float) -> None:
        state = self.state
        if state == STREAMING:
            if self.progress != self.seen_progress:
                self.seen_progress = self.progress
                self.progress_at = now
            elif now - self.progress_at >= self.ctx.config.stream_idle_timeout:
                self.cut("idle_timeout")
        elif state == WAIT_REPLICA:
            if now >= self.deadline_at:
                self.fail(http.DEADLINE, 504, "deadline_exceeded waiting for a ready replica")
            elif now >= self.empty_until:
                self.fail(http.NO_REPLICA, 503, "no_ready_replica")
            elif self.heartbeat_at and now >= self.heartbeat_at:
                self.heartbeat(now)
        elif state == SENT and self.upload_at:
            # The client is still sending the body: the idle timeout governs, not the deadline.
            if self.progress != self.seen_progress:
                self.seen_progress = self.progress
                self.progress_at = now
            elif now - self.progress_at >= self.ctx.config.stream_idle_timeout:
                self.respond(http.REQUEST_TIMEOUT, 408, close=True)
        elif state == WAIT_CONN or state == SENT:
            if now >= self.deadline_at:
                self.fail(http.DEADLINE, 504, "deadline_exceeded waiting for the response "
                          "head" if state == SENT else "deadline_exceeded waiting for a "
                          "connection")
        elif self.awaiting_body and now - self.started >= _ROUTE_WAIT:
            self.route_now()  # a slow body: route on what arrived
