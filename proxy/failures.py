"""Requests the proxy answered itself with a 502, 503 or 504 (every attempt failed, no
ready replica, the deadline passed, --max-held reached): logged at warning level,
rate-limited, so that a failure leaves a trace without a log line per request.

The first failure of a kind (replica, status, cause) logs one line with the service,
replica, method, path (without its query string), status, cause and attempts; the same
kind again within `interval` (10 s) is only counted, and when the window ends one line
says how many were suppressed. At most `max_kinds` kinds are remembered (a replica
failing with ever-new error texts cannot grow memory): beyond that they share one.

Rare path: `record` runs only for a request answered 502/503/504, `flush` from the
sweeper tick (a dict check when nothing failed). Never on a response that completes.
"""

from __future__ import annotations

import logging

log = logging.getLogger("sluice.proxy.failures")

#: Seconds one kind of failure logs at most one line in.
INTERVAL = 10.0
#: Kinds of failure remembered at once.
MAX_KINDS = 256
#: Longest cause text logged (a connect error's message names the address).
MAX_CAUSE = 200


class FailureLog:
    """Rate-limited warnings for proxy-generated 5xx answers (see the module docstring)."""

    def __init__(self, service: str | None, *, interval: float = INTERVAL,
                 max_kinds: int = MAX_KINDS) -> None:  # fmt: skip
        self._service = service or "-"
        self._interval = interval
        self._max_kinds = max_kinds
        # (replica, status, cause) -> [window end, suppressed count]
        self._windows: dict[tuple[str, int, str], list[float]] = {}

    def record(self, now: float, *, replica: str | None, status: int, cause: str,
               head_line: bytes, attempts: int) -> None:  # fmt: skip
        key = (replica or "-", status, cause[:MAX_CAUSE])
        windows = self._windows
        window = windows.get(key)
        if window is not None and now < window[0]:
            window[1] += 1
            return
        if window is not None:
            self._summarise(key, window)
        elif len(windows) >= self._max_kinds:
            self.flush(now)
            if len(windows) >= self._max_kinds:
                key = ("-", status, "other causes (too many kinds to tell apart)")
                window = windows.get(key)
                if window is not None and now < window[0]:
                    window[1] += 1
                    return
        windows[key] = [now + self._interval, 0]
        method, _, rest = head_line.partition(b" ")
        target = rest.rpartition(b" ")[0] or rest
        path = target.split(b"?", 1)[0][:200]
        log.warning(
            "upstream failure: service=%s replica=%s %s %s status=%d cause=%s attempts=%d "
            "(the same again within %.0fs is counted, not logged)", self._service, key[0],
            method.decode("latin-1"), path.decode("latin-1"), status, key[2], attempts,
            self._interval,
        )  # fmt: skip

    def flush(self, now: float) -> None:
        """End the windows that are over: a line for those that suppressed any."""
        windows = self._windows
        if not windows:
            return
        for key, window in list(windows.items()):
            if now >= window[0]:
                del windows[key]
                self._summarise(key, window)

    def _summarise(self, key: tuple[str, int, str], window: list[float]) -> None:
        if window[1]:
            log.warning(
                "upstream failure: service=%s replica=%s status=%d cause=%s: %d more "
                "suppressed in %.0fs", self._service, key[0], key[1], key[2], int(window[1]),
                self._interval,
            )  # fmt: skip
