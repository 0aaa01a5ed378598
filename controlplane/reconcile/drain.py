"""Drain until idle: when a retired replica may be stopped (docs/architecture.md,
"Drain until idle").

A replica leaving service (retired by a rollout or a scale-down, `sluice down`,
`replica remove`) is SHUTTING_DOWN: the commit that made it so also published a
snapshot without it. It keeps running until no proxy can have a request in flight on
it, then it is stopped at once; `max_drain` (the service's
`service.sluice.max_drain_seconds`, else the controller's `--drain-seconds`, Sky's
120 s by default) bounds the wait, and a replica stopped at that bound with requests
still in flight is a recorded cut (event and warning log).

The signal is the proxies' own reports, read before planning (`read_reports`): the
`{prefix}:svc:{name}:proxies` heartbeats (generation served, when each generation was
applied) and the `{prefix}:svc:{name}:inflight` entries (in-flight count per replica
URL, and when the proxy counted them). Both are written by one flush, every second.

The rule, per proxy that reported (`proxy_holds`), for a replica at URL `u` that left
the ready set at generation `G` (the lowest generation the controller saw while it was
SHUTTING_DOWN):

- the proxy is *clear* of the replica when its heartbeat says it serves a generation
  >= G, and its in-flight entry was counted after it first applied such a generation
  (both times are the proxy's own clock, so no skew between machines enters) and
  shows nothing on `u`. From that apply on, that proxy routes nothing new to `u`, so
  its count there only falls;
- otherwise it *holds* the replica (an older generation, no heartbeat, no entry, an
  entry counted before the apply, or requests on `u`).

Which proxies count (`DrainWatch.live`): every proxy id found in either hash whose
report (heartbeat `seen_at`, entry `at`) changed within `STALE_SECONDS` of the
controller's clock. Freshness is judged by change, not by comparing the proxy's
timestamps with the controller's clock, so a proxy with a skewed clock is neither
dropped early nor kept forever; a report first seen counts as a change, and so does
every report after the controller could not look for longer than `STALE_SECONDS`
(Redis down, the controller stalled: a report cannot be seen changing then).

A report that stopped changing is a proxy that died, lost Redis, or is stalled: the
three look alike from here, and only the first has no clients. A live proxy's
flushes were seen to stop for 7.5 s on a busy 2-core VM (its process runnable, not
run), with a stream in flight on a draining replica; stopping the replica after
`STALE_SECONDS` cut that stream. So a stale proxy whose last report shows requests on
the replica keeps holding it (`DrainWatch.verdict`) until its report has not changed
for `HOLD_SECONDS`, within the drain bound; one whose last report shows nothing there
holds nothing once stale (from its next apply on it routes nothing new there, and a
request it sends to a stopped replica fails to connect and is retried elsewhere).
A proxy that died with requests on a draining replica costs that replica
`HOLD_SECONDS` more of running, no more.
A proxy that never reported (started less than a flush ago, still on an older
snapshot) is covered by `SETTLE_SECONDS`: no replica is stopped sooner than that after
it left the set, by which time every proxy that could have routed to it has flushed.
A proxy that joined after the replica left serves a generation >= G from its first
report and never routed to it: it holds nothing.

Proxies without Redis (`--replicas`, drop-in mode) report nothing: sluice cannot see
them, and the bound applies. No I/O here but `read_reports`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.store import Store
from proxy.wire.telemetry import InflightEntry, ProxyHeartbeat

#: A proxy whose report has not changed for this long (controller clock) is no longer
#: vouched for: it is clear of nothing, and holds only what its last report named.
STALE_SECONDS = 5.0
#: A stale proxy's last report of requests on a replica holds it this long after the
#: report last changed: longer than a stalled proxy or a Redis failover's gap.
HOLD_SECONDS = 30.0
#: No replica is stopped sooner than this after it left the ready set: every proxy
#: flushes its report every second, including one that had not reported yet.
SETTLE_SECONDS = 2.0
#: How often a draining replica is looked at again (the proxies flush every second).
POLL_SECONDS = 0.5
#: `store.telemetry.read_proxies` deletes heartbeats older than this by the controller's
#: clock. Liveness is judged here by change, so the drain read deletes nothing a skewed
#: clock could make look old (`sluice status` and the hash's TTL clear long-gone proxies).
_HEARTBEAT_GC_SECONDS = 86400.0


@dataclass(frozen=True, slots=True)
class DrainReports:
    """What the proxies reported, read before planning."""

    generation: int  # the snapshot generation in Redis when read
    heartbeats: dict[str, ProxyHeartbeat] = field(default_factory=dict)
    inflight: dict[str, InflightEntry] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DrainVerdict:
    """A draining replica, judged: `idle` when no live proxy holds it; `inflight` is
    the requests the live proxies report on it; `holders` the proxy ids holding it."""

    idle: bool
    inflight: int
    holders: tuple[str, ...] = ()


async def read_reports(store: Store, name: str, generation: int) -> DrainReports:
    """The proxies' heartbeats and in-flight entries of `name` (`generation`: the
    generation read with the replica table)."""
    heartbeats = await store.telemetry.read_proxies(name, stale_after=_HEARTBEAT_GC_SECONDS)
    inflight = await store.telemetry.read_inflight(name)
    return DrainReports(generation, heartbeats, inflight)


def first_applied(beat: ProxyHeartbeat, generation: int) -> float | None:
    """When (proxy clock) the proxy first applied a generation >= `generation`, as far
    as its heartbeat tells; None when it serves an older one."""
    if beat.generation < generation:
        return None
    times = [at for gen, at in beat.recent if gen >= generation]
    return min(times) if times else beat.applied_at


def proxy_holds(
    url: str, generation: int, beat: ProxyHeartbeat | None, entry: InflightEntry | None
) -> tuple[bool, int]:
    """(holds, in flight on `url`) for one live proxy; see the module docstring."""
    count = entry.replicas.get(url, 0) if entry is not None else 0
    count = max(0, count)
    if beat is None or entry is None:
        return True, count
    applied = first_applied(beat, generation)
    if applied is None or entry.at < applied:
        return True, count
    return count > 0, count


class DrainWatch:
    """The controller's memory for draining: when each proxy's report last changed
    (controller clock), and the generation each draining replica left the set at."""

    def __init__(self) -> None:
        # service -> proxy id -> (its report's timestamps, when they last changed)
        self._seen: dict[str, dict[str, tuple[tuple[float, float], float]]] = {}
        # service -> when its reports were last looked at (controller clock)
        self._looked: dict[str, float] = {}
        # service -> the stale proxies still holding what their last report named
        self._holding: dict[str, set[str]] = {}
        # (service, replica id) -> the lowest generation seen while it drained
        self._left_at: dict[tuple[str, int], int] = {}

    def live(self, name: str, reports: DrainReports, now: float) -> set[str]:
        """The proxies of `name` whose report changed within STALE_SECONDS (and, kept
        for `verdict`, the stale ones whose report changed within HOLD_SECONDS)."""
        seen = self._seen.setdefault(name, {})
        ids = reports.heartbeats.keys() | reports.inflight.keys()
        for proxy_id in list(seen):
            if proxy_id not in ids:
                del seen[proxy_id]
        looked = self._looked.get(name)
        self._looked[name] = now
        blind = looked is None or now - looked > STALE_SECONDS  # could not see changes
        live = set()
        holding = set()
        for proxy_id in ids:
            beat = reports.heartbeats.get(proxy_id)
            entry = reports.inflight.get(proxy_id)
            stamp = (beat.seen_at if beat else 0.0, entry.at if entry else 0.0)
            last = seen.get(proxy_id)
            if blind or last is None or last[0] != stamp:
                seen[proxy_id] = (stamp, now)
                live.add(proxy_id)
            elif now - last[1] <= STALE_SECONDS:
                live.add(proxy_id)
            elif now - last[1] <= HOLD_SECONDS:
                holding.add(proxy_id)
        self._holding[name] = holding
        return live

    def verdict(
        self, name: str, replica_id: int, url: str, reports: DrainReports, live: set[str]
    ) -> DrainVerdict:
        """Whether replica `replica_id` (at `url`) of `name` is idle now."""
        key = (name, replica_id)
        generation = min(self._left_at.get(key, reports.generation), reports.generation)
        self._left_at[key] = generation
        holders = []
        total = 0
        for proxy_id in sorted(live):
            holds, count = proxy_holds(url, generation, reports.heartbeats.get(proxy_id),
                                       reports.inflight.get(proxy_id))  # fmt: skip
            total += count
            if holds:
                holders.append(proxy_id)
        for proxy_id in sorted(self._holding.get(name, set()) - live):
            entry = reports.inflight.get(proxy_id)
            count = max(0, entry.replicas.get(url, 0)) if entry is not None else 0
            if count:  # stale, but its last report has requests here: it may be stalled
                total += count
                holders.append(proxy_id)
        return DrainVerdict(not holders, total, tuple(holders))

    def done(self, name: str, replica_id: int) -> None:
        """The replica is stopped (or gone): forget it."""
        self._left_at.pop((name, replica_id), None)

    def forget(self, name: str) -> None:
        self._seen.pop(name, None)
        self._looked.pop(name, None)
        self._holding.pop(name, None)
        for key in [k for k in self._left_at if k[0] == name]:
            del self._left_at[key]
