"""Resuming a streamed completion on another replica when its replica fails mid-stream.

Opt-in (`--resume-streams`, or the service's `service.sluice.resume_streams`;
docs/resume.md says what is and is not preserved). The client connection
(server.py) creates a `ResumableExchange` instead of an Exchange only for
`POST /v1/chat/completions` and `POST /v1/completions` while resuming is on; every
other request, and every request with resuming off, runs the plain Exchange with
nothing added to its path.

A ResumableExchange watches its response when it is a 200 `text/event-stream`
answer to a `"stream": true` body that the exchange still holds in full. Then it
relays only complete SSE events (the tail of a chunk after the last blank line
waits for the next chunk, so the client never holds half an event) and keeps the
bytes it relayed, unparsed. When the upstream fails after the response started
(connection lost, the body ended before `data: [DONE]`, the idle timeout, a broken
response) it:

1. parses what it relayed (proxy/continuation.py) and builds the continuation
   request: the original body plus the text so far, `max_tokens` reduced;
2. sends it to another ready replica, with the exchange's own retry machinery (a
   fresh `--retry-deadline` for its response head, `--max-attempts`), while the
   client keeps its open response (held-stream mode: only body bytes follow, SSE
   heartbeats if `--hold-heartbeat` is set);
3. relays the continuation's events rewritten by a `Seam` (the first part's id,
   created and model; no second role chunk; usage shifted) into the same chunked
   response, up to its `data: [DONE]`.

At most `--resume-attempts` continuations per stream. A stream that cannot be
resumed (attempts used up, no replica answered in time, a request or stream it
cannot continue: tool calls, several choices, token-id prompts) ends as it would
without resuming: the connection closes without the last chunk, and it is counted.

Metrics: `Stats.resumes[(replica cut, cause, outcome)]`, outcome `attempted`,
`succeeded` (the continuation's 200 head arrived from another replica) or `failed`;
one WARNING log line per resume attempt and per failure (rare paths only).
"""

from __future__ import annotations

import logging
import re

from proxy import http
from proxy.continuation import Continue, Kind, NotResumable, Seam, event_end, plan
from proxy.exchange import DONE, NEW, STREAMING, Exchange, ExchangeContext
from proxy.interfaces import ClientView, ConnectionPool, UpstreamLink
from proxy.outcomes import MARKER, NO_REPORT, SCAN_FROM, cached_tokens

log = logging.getLogger("sluice.proxy")

_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
_DONE_TAIL = re.compile(rb"data: ?\[DONE\]\s*$")
_PATHS: dict[bytes, Kind] = {b"/v1/chat/completions": "chat", b"/v1/completions": "completion"}
# The most response bytes kept for one stream; a longer stream is no longer resumable.
KEEP_LIMIT = 8 * 1024 * 1024


def resumable_kind(method: bytes, url: bytes) -> Kind | None:
    """The endpoint kind of a request that may be resumed (None: not such a request)."""
    if method != b"POST":
        return None
    return _PATHS.get(url.split(b"?", 1)[0])


class ResumableExchange(Exchange):
    """An Exchange for a completions endpoint whose stream can be resumed (module doc)."""

    __slots__ = (
        "attempt",
        "continuing",
        "kept",
        "kind",
        "original",
        "original_tail",
        "partial",
        "relayed",
        "resumes",
        "seam",
        "watch",
    )

    def __init__(self, ctx: ExchangeContext, client: ClientView, method: bytes,
                 head_line: bytes, head_tail: bytes, *, kind: Kind, keep_alive: bool,
                 chunked: bool, started: float, has_body: bool = False) -> None:
        super().__init__(ctx, client, method, head_line, head_tail, keep_alive=keep_alive,
                         chunked=chunked, started=started, has_body=has_body)
        self.kind: Kind = kind
        self.watch = False  # this response is a stream we can resume
        self.relayed: list[bytes] = []  # complete events relayed to the client, as relayed
        self.kept = 0
        self.partial = b""  # the start of an event whose end has not arrived
        self.resumes = 0
        self.continuing = False  # a continuation is on its way: the client has our head
        self.seam: Seam | None = None
        self.attempt: tuple[str, str] | None = None  # (replica cut, cause) being resumed
        self.original: bytes | None = None  # the client's body, once replaced
        self.original_tail = b""

    # -- the response -------------------------------------------------------------------

    def on_response_headers(self, conn: UpstreamLink, status: int,
                            headers: list[tuple[bytes, bytes]]) -> bool:
        if not self.continuing:
            no_body = super().on_response_headers(conn, status, headers)
            if (self.state == STREAMING and status == 200 and self.resp_chunked
                    and not self.discard_body and _is_plain_event_stream(headers)
                    and self.body_done and self.body_whole
                    and _STREAM_TRUE.search(b"".join(self.body))):
                self.watch = True
            return no_body
        # A continuation's head: the client has had ours since the first part.
        if status != 200 or not _is_plain_event_stream(headers):
            self.last_error = f"HTTP {status} to a continuation"
            self.detach_upstream(abort=True)
            self.release_replica()
            if self.can_retry():
                self.ctx.stats.retries += 1
                self.pick()
            else:
                self._give_up("continuation_refused")
            return False
        self.state = STREAMING
        self.continuing = False
        self.watch = True
        names = {name.lower() for name, _ in headers}
        if b"content-length" not in names and b"transfer-encoding" not in names:
            conn.body_framed = False
        self.progress_at = self.ctx.now
        if self.attempt is not None:
            self._count(self.attempt, "succeeded")
        return False

    def on_response_body(self, data: bytes) -> None:
        if not self.watch:
            super().on_response_body(data)
            return
        self.progress += 1
        self.resp_bytes += len(data)  # the replica's bytes (access log, a cut's log line)
        if self.outcome is not None and data.find(MARKER, SCAN_FROM) >= 0:
            self.cached = cached_tokens(data, self.cached)  # as Exchange does (outcomes.py)
        if self.partial:
            data = self.partial + data
            self.partial = b""
        end = event_end(data)
        if end != len(data):
            self.partial = data[end:]
            data = data[:end]
            if not data:
                return
        seam = self.seam
        if seam is not None:
            data = seam.rewrite(data)
            if not data:
                return
        self.kept += len(data)
        if self.kept > KEEP_LIMIT:
            self.watch = False  # too long to keep: relayed as a plain stream from here
            self.relayed.clear()
        else:
            self.relayed.append(data)
        self.last_chunk = data
        if self.prefill_on is not None:
            self.prefilled()
        out = self.out
        out.append(b"%x\r\n" % len(data))
        out.append(data)
        out.append(http.CRLF)

    def on_response_complete(self, conn: UpstreamLink, reusable: bool) -> None:
        if not self.watch or self._saw_done():
            super().on_response_complete(conn, reusable)
            return
        # The body ended (closed, or framed) before data: [DONE].
        conn.served += 1
        self.upstream = None
        pool: ConnectionPool = self.pool  # type: ignore[assignment]
        pool.release(conn, reusable and self.body_done)
        self._resume("eof")

    def on_upstream_lost(self, conn: UpstreamLink, in_response: bool) -> None:
        if self.watch and (self.state == STREAMING or in_response):
            self.upstream = None
            self._resume("reset")
            return
        super().on_upstream_lost(conn, in_response)

    def on_upstream_error(self, error: str) -> None:
        if self.watch and self.state == STREAMING:
            self._resume("bad_response")
            return
        super().on_upstream_error(error)

    def respond(self, response: bytes, status: int, close: bool = False) -> None:
        if self.continuing and self.state != DONE:
            # No replica took the continuation (503, 504, 502): the stream cannot go on.
            self._give_up(_GIVE_UP.get(status, f"http_{status}"))
            return
        super().respond(response, status, close)

    def tick(self, now: float) -> None:
        if (self.watch and self.state == STREAMING and self.progress == self.seen_progress
                and now - self.progress_at >= self.ctx.config.stream_idle_timeout):
            self._resume("idle_timeout")
            return
        super().tick(now)

    # -- resuming -------------------------------------------------------------------------

    def _saw_done(self) -> bool:
        partial = self.partial
        if partial and _DONE_TAIL.search(partial):
            self.on_response_body(b"\n")  # "data: [DONE]\n" then the close: complete it
            return True
        relayed = self.relayed
        return bool(relayed) and _DONE_TAIL.search(relayed[-1][-32:]) is not None

    def _resume(self, cause: str) -> None:
        """The upstream failed mid-stream: continue on another replica, or end the stream."""
        replica = self.replica
        cut_url = replica.url if replica is not None else "unknown"
        self.detach_upstream(abort=True)
        self.release_replica()
        if self._saw_done():
            # Everything came but the body's end: end it (nothing to resume).
            self.out.append(http.LAST_CHUNK)
            self.flush_client()
            self.ctx.stats.count_response(self.status)
            self.finish(self.close_after)
            return
        self.partial = b""  # never sent: its content is generated again
        self.cached = NO_REPORT  # the next replica's report counts, for the next replica
        self.flush_client()
        attempt = self.attempt = (cut_url, cause)
        self._count(attempt, "attempted")
        cfg = self.ctx.config
        if self.resumes >= cfg.resume_attempts:
            self._give_up("attempts_exhausted")
            return
        self.resumes += 1
        if self.original is None:
            self.original = b"".join(self.body)
            self.original_tail = self.head_tail
        try:
            step = plan(self.kind, self.original, b"".join(self.relayed), self.resumes)
        except NotResumable as exc:
            self._give_up(exc.reason)
            return
        if not isinstance(step, Continue):
            # The answer was complete; only its ending was lost.
            self._count(attempt, "succeeded")
            if step.tail:
                self.out.append(http.chunk(step.tail))
            self.out.append(http.LAST_CHUNK)
            self.flush_client()
            self.ctx.stats.count_response(self.status)
            self.finish(self.close_after)
            return
        log.warning("stream cut by %s (%s) after %d bytes: continuing on another replica "
                    "(resume %d of %d)", cut_url, cause, self.kept, self.resumes,
                    cfg.resume_attempts)
        body = step.body
        self.seam = step.seam
        self.head_tail = _with_length(self.original_tail, len(body))
        self.chunked = False
        self.body = [body]
        self.body_len = len(body)
        self.body_done = True
        self.body_whole = True
        self.attempts = 0
        self.stale_retry_used = False
        self.deadline_at = self.ctx.loop.time() + cfg.retry_deadline
        self.watch = False
        self.continuing = True
        self.sse_held = True  # the client has our head: heartbeats and errors are events
        self.state = NEW
        self.pick()

    def _give_up(self, reason: str) -> None:
        attempt = self.attempt or ("unknown", "unknown")
        self._count(attempt, "failed")
        log.warning("stream cut by %s (%s) not resumed: %s", attempt[0], attempt[1], reason)
        self.continuing = False
        self.watch = False
        Exchange.cut(self, _CUT_CAUSE.get(attempt[1], "unknown"))

    def _count(self, attempt: tuple[str, str], outcome: str) -> None:
        resumes = self.ctx.stats.resumes
        key = (attempt[0], attempt[1], outcome)
        resumes[key] = resumes.get(key, 0) + 1


# The resume's cause of the cut, as the cut-stream metric names it (proxy/cuts.py).
_CUT_CAUSE = {"eof": "upstream_eof", "reset": "upstream_reset", "idle_timeout": "idle_timeout",
              "bad_response": "upstream_error"}
_GIVE_UP = {502: "no_replica_answered", 503: "no_ready_replica", 504: "deadline"}


def _is_plain_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    """An uncompressed `text/event-stream` response (one we can read and cut)."""
    event_stream = False
    for name, value in headers:
        lname = name.lower()
        if lname == b"content-type":
            event_stream = value.lower().startswith(b"text/event-stream")
        elif lname == b"content-encoding" and value.strip().lower() != b"identity":
            return False
    return event_stream


def _with_length(head_tail: bytes, length: int) -> bytes:
    """The request's header lines with the continuation's framing (Content-Length)."""
    lines = [line for line in head_tail.split(http.CRLF)
             if line and line.split(b":", 1)[0].strip().lower()
             not in (b"content-length", b"transfer-encoding")]
    lines.append(b"Content-Length: %d" % length)
    return http.CRLF.join(lines) + http.CRLF + http.CRLF
