"""The cumulative counters a proxy puts in its heartbeat (proxy/wire/telemetry.py
ProxyHeartbeat): responses by class, cut responses, and the prefix policy's routing
reasons summed over replicas, kept monotonic although the policy's per-replica counters
go when a replica is swept and start again when a snapshot changes the policy.
Built once a second by the heartbeat, never per request."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.prefix import REASONS
from proxy.stats import Stats

CLASSES = ("2xx", "3xx", "4xx", "5xx")


def response_classes(responses: Mapping[int, int]) -> dict[str, int]:
    """Status code -> count, as "2xx".."5xx" -> count (every class present)."""
    out = dict.fromkeys(CLASSES, 0)
    for code, count in responses.items():
        name = f"{code // 100}xx"
        if name in out:
            out[name] += count
    return out


def cut_total(stats: Stats) -> int:
    return sum(stats.cuts.values())


class RoutedTally:
    """Monotonic totals of the prefix policy's reasons (see the module docstring)."""

    def __init__(self) -> None:
        self._totals = [0] * len(REASONS)
        self._policy: object = None
        self._seen: dict[str, list[int]] = {}  # url -> counts at the last read

    def read(self, policy: object) -> dict[str, int]:
        """The totals, given the policy in force ({} if it counts no reasons)."""
        routed = getattr(policy, "routed", None)
        if not isinstance(routed, dict):
            return {}
        if policy is not self._policy:  # a new policy object counts from 0
            self._policy, self._seen = policy, {}
        totals, seen = self._totals, self._seen
        now: dict[str, list[int]] = {}
        for url, counts in routed.items():
            before = seen.get(url)
            for i, count in enumerate(counts[:len(totals)]):
                last = before[i] if before is not None else 0
                totals[i] += count - last if count >= last else count
            now[url] = list(counts)
        self._seen = now
        return dict(zip(REASONS, totals, strict=True))
