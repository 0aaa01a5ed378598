"""Rates from the proxies' cumulative heartbeat counters (proxy/wire/telemetry.py
ProxyHeartbeat: responses by class, cut responses, routing reasons): per proxy, the
difference between two successive heartbeats over the time between them, summed over
the proxies of a service.

The proxies' Redis user writes these, so every value is distrusted: a count that is not
a finite number >= 0 is skipped, counts are clamped to MAX_COUNT, at most MAX_REASONS
reason keys (short names) are read, and a rate is clamped to MAX_RATE. A counter that
went down is a proxy that restarted (or a new policy): its new value is what it counted
since (Prometheus' rule). A heartbeat that has not changed keeps its proxy's last rate
(the poller and the proxies both tick once a second, out of phase); one older than
FRESH_SECONDS, or a first one, contributes nothing. Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.wire.telemetry import ProxyHeartbeat

MAX_COUNT = 2**53
MAX_RATE = 1e7
MAX_REASONS = 8
MAX_REASON_NAME = 32
FRESH_SECONDS = 5.0
#: Two heartbeats further apart than this give no rate (a proxy that stalled).
MAX_GAP_SECONDS = 30.0


def _count(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return float(min(value, MAX_COUNT))


def counters(beat: ProxyHeartbeat) -> dict[str, float] | None:
    """A heartbeat's counters, sanitised: "errors" (5xx + cuts), "responses" (all
    classes), "reason:NAME" per routing reason; None from a proxy that sends none."""
    if not isinstance(beat.responses, Mapping) or not beat.responses:
        return None
    out: dict[str, float] = {}
    total = 0.0
    for name in ("2xx", "3xx", "4xx", "5xx"):
        value = _count(beat.responses.get(name, 0))
        if value is not None:
            total += value
    five = _count(beat.responses.get("5xx", 0)) or 0.0
    cuts = _count(beat.cuts) or 0.0
    out["errors"] = min(five + cuts, MAX_COUNT)
    out["responses"] = min(total, MAX_COUNT)
    if isinstance(beat.routed, Mapping):
        for reason, value in list(beat.routed.items())[:MAX_REASONS]:
            count = _count(value)
            if (count is not None and isinstance(reason, str)
                    and 0 < len(reason) <= MAX_REASON_NAME):
                out["reason:" + reason] = count
    return out


@dataclass
class _Last:
    seen_at: float
    counts: dict[str, float]
    rates: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Rates:
    """A service's rates now; None where no fresh proxy reports the counter."""

    errors_per_s: float | None = None
    responses_per_s: float | None = None
    routed: dict[str, float] | None = None  # reason -> requests/s


class RateTracker:
    """Per service and proxy, the last heartbeat read; rates from the next one."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, _Last]] = {}

    def forget(self, service: str) -> None:
        self._last.pop(service, None)

    def update(self, service: str, beats: Mapping[str, ProxyHeartbeat], now: float) -> Rates:
        previous = self._last.get(service, {})
        kept: dict[str, _Last] = {}
        sums: dict[str, float] = {}
        reporting = False
        for proxy_id, beat in beats.items():
            counts = counters(beat)
            seen_at = beat.seen_at
            if counts is None or not isinstance(seen_at, int | float) or not math.isfinite(
                    seen_at):
                continue
            last = previous.get(proxy_id)
            if last is not None and seen_at == last.seen_at:
                rates = last.rates  # the same heartbeat again: its proxy's last rate
                kept[proxy_id] = last
            else:
                rates = {}
                gap = seen_at - last.seen_at if last is not None else 0.0
                if last is not None and 0 < gap <= MAX_GAP_SECONDS:
                    for key, value in counts.items():
                        before = last.counts.get(key)
                        if before is None:
                            continue
                        delta = value - before if value >= before else value
                        rates[key] = min(delta / gap, MAX_RATE)
                kept[proxy_id] = _Last(seen_at, counts, rates)
            if now - seen_at > FRESH_SECONDS:
                continue
            reporting = True
            for key, rate in rates.items():
                sums[key] = sums.get(key, 0.0) + rate
        self._last[service] = kept
        if not reporting:
            return Rates()
        routed = {k.removeprefix("reason:"): v for k, v in sums.items() if k.startswith("reason:")}
        any_routed = any(
            key.startswith("reason:") for last in kept.values() for key in last.counts)
        return Rates(errors_per_s=sums.get("errors", 0.0),
                     responses_per_s=sums.get("responses", 0.0),
                     routed=routed if any_routed else None)  # fmt: skip
