"""Warm copies: a family's new replica computes its prompt before a client waits on it.

When the `prefix` policy gives a hot prompt family another replica (a new secondary, or
a third copy: proxy/prefix.py), the first request sent there computes the family's
whole prompt cold, and waits that long for its first token: on the simulator a cold
1,200-token prompt takes 0.33 s where a cached one takes 0.05 s, and those cold firsts
were the p99 of a workload whose hot family a replica could still carry
(bench/README.md, "Warm copies"). With `warm_copies` on (the default since 2026-12-06;
`--no-prefix-warm-copies`, YAML `prefix: {warm_copies: false}` turn it off), the policy
sends that request to a replica that holds
the prompt already, and the proxy sends the new replica a **warm-up** instead: the same
body with `max_tokens` 1, not streamed. Its answer is thrown away; the engine keeps the
prompt's KV cache (vLLM's and SGLang's prefix caches, llama.cpp's slot), so the
family's next requests there are hits. Until it answers, the family's overflow waits
where the prompt is (`Family.warming`, as for a cold first request).

Nearly off the request path: the policy only names the replica; the exchange hands the
body it holds in full to `Warmer.start`, which checks the path and the count, then
rewrites the body (one JSON decode and encode per new copy, a rare event: a few a minute
on a busy fleet) and sends it in a task. Bounded: at most `MAX_RUNNING` warm-ups at once
per proxy process (one more is skipped), each within `TIMEOUT` seconds (the hold on the
family's overflow, `placement.WARM_HOLD`, lasts as long), the answer's body not read.
The warm-up counts in the replica's `inflight`, `prefilling` and `prefill_bytes` while it
runs, as a client's cold request would. Outcomes are counted (`Stats.warmups`: `sent`, `warmed`,
`failed`, `skipped`); a failure is logged at INFO, at most one line per `LOG_EVERY`
seconds. Any warm-up not answered 2xx leaves the copy as without the option: its next
request computes the prompt (PrefixPolicy._warm_done).

Only `POST /v1/chat/completions` and `POST /v1/completions` with a JSON object body the
exchange holds in full are warmed; anything else is skipped. A prompt longer than the
policy's `prefix_bytes` is routed before its body is complete, so it is not warmed. The
warm-up carries the headers the exchange forwards (already cleaned of hop-by-hop and
spoofable ones, with the proxy's own X-Forwarded-For: so the client's `Authorization`
too, for a replica that checks one), without framing, and `X-Sluice-Warmup: 1`; it goes
to the replica's own scheme, host and path prefix, and follows no redirect.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
import msgspec

from proxy.interfaces import ReplicaView
from proxy.placement import WARM_HOLD
from proxy.stats import Stats

log = logging.getLogger("sluice.proxy")

MAX_RUNNING = 4  # warm-ups in flight at once, per proxy process
TIMEOUT = WARM_HOLD  # s; a warm-up not answered by then is abandoned (the hold ends too)
LOG_EVERY = 10.0  # s; at most one INFO line about failed warm-ups this often
MAX_BODY = 1 << 20  # bytes; a larger body is not warmed
PATHS = (b"/v1/chat/completions", b"/v1/completions")
WARMUP_HEADER = ("X-Sluice-Warmup", "1")
# Not taken from the forwarded headers: framing, the body's type (set here), and ours.
_DROPPED = frozenset({
    b"content-length", b"transfer-encoding", b"host", b"content-type", b"accept-encoding",
    b"x-sluice-warmup",
})
# Output-shaping fields a one-token answer cannot satisfy (an engine would refuse it).
_OUTPUT_FIELDS = ("stream_options", "min_tokens")

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def warm_path(head_line: bytes) -> str | None:
    """The path (and query) of a request line to warm up on, else None.

    Only `POST` to the two completion endpoints, in origin form.
    """
    parts = head_line.split(b" ")
    if len(parts) != 3 or parts[0] != b"POST":
        return None
    target = parts[1]
    if target.split(b"?", 1)[0] not in PATHS:
        return None
    try:
        return target.decode("ascii")
    except UnicodeDecodeError:
        return None


def warm_body(body: bytes) -> bytes | None:
    """The warm-up body for a completion request `body`: the same prompt and parameters,
    one token (`max_tokens`, and `max_completion_tokens` where given), one choice, not
    streamed. None when `body` is not a JSON object (or longer than MAX_BODY)."""
    if len(body) > MAX_BODY:
        return None
    try:
        doc = _decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    doc["max_tokens"] = 1
    if "max_completion_tokens" in doc:
        doc["max_completion_tokens"] = 1
    if "n" in doc:
        doc["n"] = 1
    doc["stream"] = False
    for field in _OUTPUT_FIELDS:
        doc.pop(field, None)
    return _encode(doc)


def warm_headers(head_tail: bytes) -> list[tuple[str, str]]:
    """The warm-up's headers: the lines the exchange forwards (`head_tail`, as cleaned by
    the server), without framing, plus Content-Type and X-Sluice-Warmup."""
    out = [("Content-Type", "application/json"), WARMUP_HEADER]
    for line in head_tail.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() not in _DROPPED:
            out.append((name.strip().decode("latin-1"), value.strip().decode("latin-1")))
    return out


def warm_url(replica: ReplicaView, path: str) -> str:
    """Where the warm-up goes: the replica's scheme, Host and path prefix, then `path`."""
    scheme = urlsplit(replica.url).scheme
    return f"{scheme}://{replica.host_header.decode('ascii')}" \
           f"{replica.path.decode('ascii')}{path}"


class Warmer:
    """Sends warm-ups (see the module docstring); one per proxy process."""

    def __init__(self, stats: Stats, *, max_running: int = MAX_RUNNING,
                 timeout: float = TIMEOUT) -> None:
        self.stats = stats
        self.max_running = max_running
        self.timeout = timeout
        self.running: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._logged_at = 0.0

    def start(self, replica: ReplicaView, head_line: bytes, head_tail: bytes, body: bytes,
              done: Callable[[bool], None]) -> bool:
        """Warm `replica` up with this request's prompt; `done(ok)` is called once, when
        the warm-up answered 2xx (True) or failed, timed out or was skipped (False; a
        warm-up cancelled by `aclose` before it began is not reported: the process is
        stopping). Returns whether it was sent (False: `done(False)` was called)."""
        path = warm_path(head_line) if len(self.running) < self.max_running else None
        warm = warm_body(body) if path is not None else None
        if path is None or warm is None:
            self._count("skipped")
            done(False)
            return False
        task = asyncio.get_running_loop().create_task(
            self._run(replica, warm_url(replica, path), warm_headers(head_tail), warm, done))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        self._count("sent")
        return True

    async def _run(self, replica: ReplicaView, url: str, headers: list[tuple[str, str]],
                   body: bytes, done: Callable[[bool], None]) -> None:
        replica.inflight += 1
        replica.prefilling += 1
        replica.prefill_bytes += len(body)
        ok = False
        error = ""
        try:
            session = self._session
            if session is None or session.closed:
                session = self._session = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=self.timeout),
                    connector=aiohttp.TCPConnector(limit=self.max_running))
            async with session.post(url, data=body, headers=headers,
                                    allow_redirects=False) as resp:
                ok = 200 <= resp.status < 300  # the body is not read: released unread
                if not ok:
                    error = f"HTTP {resp.status}"
        except asyncio.CancelledError:
            error = "cancelled"
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            error = str(exc) or type(exc).__name__
        finally:
            replica.inflight -= 1
            replica.prefilling -= 1
            replica.prefill_bytes -= len(body)
            self._count("warmed" if ok else "failed")
            if not ok:
                now = time.monotonic()
                if now - self._logged_at >= LOG_EVERY:
                    self._logged_at = now
                    log.info("warm-up of %s failed (%s); the family's next request there "
                             "computes its prompt", replica.url, error[:200])
            done(ok)

    def _count(self, outcome: str) -> None:
        warmups = self.stats.warmups
        warmups[outcome] = warmups.get(outcome, 0) + 1

    async def aclose(self) -> None:
        """Cancel the running warm-ups and close the HTTP session."""
        for task in list(self.running):
            task.cancel()
        if self.running:
            await asyncio.gather(*self.running, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
