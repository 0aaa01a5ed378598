"""Responses cut short: a response whose head was relayed but whose body ended before
its framing said it was complete (the replica closed or reset the connection
mid-body, the idle timeout between chunks fired, the replica broke a limit, the client
sent more body than `--max-body` while the response streamed).

Each is counted by cause (`Stats.cuts`, exported as `sluice_responses_cut_total
{cause}`; it is *not* counted in `sluice_responses_total{code}`, which counts complete
responses) and logged once at warning level with the service, replica, method, path
(without its query string, which may carry secrets), bytes relayed and duration.
Rare path: at most once per request, never on a response that completes.
"""

from __future__ import annotations

import logging

from proxy.stats import Stats

log = logging.getLogger("sluice.proxy.cuts")

#: Why a response was cut (the `cause` label). `upstream_eof`: the replica closed the
#: connection mid-body (stopped, crashed, SIGKILLed: the kernel closes its sockets);
#: `upstream_reset`: the connection failed with an error (RST); `idle_timeout`: no body
#: byte for `--stream-idle-timeout`; `upstream_error`: the replica broke a limit
#: (oversized trailers); `request_too_large`: the request body passed `--max-body`
#: after the response had started; `unknown`: ended by a caller that gave no cause.
CAUSES = ("upstream_eof", "upstream_reset", "idle_timeout", "upstream_error",
          "request_too_large", "unknown")


def record_cut(
    stats: Stats, cause: str, *, service: str | None, replica: str, head_line: bytes,
    sent: int, seconds: float, status: int,
) -> None:  # fmt: skip
    """Count one cut response and log it (see the module docstring)."""
    cuts = stats.cuts
    cuts[cause] = cuts.get(cause, 0) + 1
    method, _, rest = head_line.partition(b" ")
    target = rest.rpartition(b" ")[0] or rest
    path = target.split(b"?", 1)[0][:200]
    log.warning(
        "cut response: service=%s replica=%s %s %s status=%d cause=%s bytes=%d "
        "duration=%.3fs", service or "-", replica, method.decode("latin-1"),
        path.decode("latin-1"), status, cause, sent, seconds,
    )  # fmt: skip
