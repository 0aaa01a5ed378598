"""What the dashboard shows, as plain JSON-ready dicts: pure functions from one poll of
a service (`Reading`) to the fleet row, the service document and one chart sample.

The replica rows are `sluice status --json`'s (`ops.ServiceView`, encoded the same way)
with a few derived fields added (in-flight, reason, age, engine), so the page and the
CLI cannot disagree about ids, states and versions.

Engine telemetry is optional: where the service has an engine view
(`store.telemetry.read_engines(name)`: replica id -> a struct or mapping of scalars, e.g.
running, waiting, kv_usage, ttft_p50, as the `replicas` of a view), each replica that has
one gets an `engine` dict; otherwise the key is absent. Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from controlplane.dashboard.rates import Rates
from controlplane.ops import ServiceView
from controlplane.records import Event
from controlplane.states import GONE, ReplicaStatus
from proxy.wire.telemetry import InflightEntry

#: An in-flight entry older than this is a proxy that stopped (autoscaling's rule).
INFLIGHT_FRESH_SECONDS = 3.0
#: Engine fields the page charts or puts in columns, when present.
TTFT_FIELDS = ("ttft_p50", "ttft_p50_s", "ttft")
#: Longest string of an engine value shown (the rest is cut): the values are untrusted.
MAX_ENGINE_TEXT = 80
MAX_ENGINE_FIELDS = 24
#: Fields every scraped replica has, engine or not: alone, they say it is not an engine.
ENGINE_BOOKKEEPING = frozenset({"url", "at", "engine", "error"})

Scalar = str | int | float | bool | None
JSON = dict[str, Any]


@dataclass(frozen=True)
class Reading:
    """Everything one poll read about one service."""

    view: ServiceView
    events: list[Event]
    rps: dict[int, int]
    inflight: dict[str, InflightEntry]
    engines: dict[int, dict[str, Scalar]] = field(default_factory=dict)
    # From the proxies' heartbeat counters (controlplane/dashboard/rates.py).
    rates: Rates = field(default_factory=Rates)


def engine_scalars(value: object) -> dict[str, Scalar]:
    """An engine entry (a Struct or a mapping) as a small dict of scalars; anything else
    (None, nested values, non-finite numbers) is dropped, long strings are cut."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if not isinstance(value, Mapping):
        return {}
    out: dict[str, Scalar] = {}
    for key, item in value.items():
        if len(out) >= MAX_ENGINE_FIELDS:
            break
        if isinstance(item, float) and not math.isfinite(item):
            continue
        if isinstance(item, str):
            item = item[:MAX_ENGINE_TEXT]
        if item is None:
            continue  # not reported by this engine: shown as absent, not as a value
        if isinstance(item, str | int | float | bool):
            out[str(key)[:MAX_ENGINE_TEXT]] = item
    return out


def is_engine(entry: Mapping[str, Scalar]) -> bool:
    """Whether a scraped entry describes a model server: a plain HTTP app is scraped too
    and reports only the scrape's own fields (`engine: unknown`, its URL and time)."""
    if entry.get("engine", "unknown") != "unknown":
        return True
    return any(key not in ENGINE_BOOKKEEPING for key in entry)


def requests_per_second(rps: Mapping[int, int], now: float) -> int:
    """Requests in the last complete second the proxies have flushed (they flush about
    every second, so the second before last is the newest one that is whole)."""
    return rps.get(int(now) - 2, 0)


def inflight_by_url(
    inflight: Mapping[str, InflightEntry], now: float
) -> tuple[int, dict[str, int]]:
    """(total, replica URL -> count) over the proxies that reported recently."""
    total = 0
    by_url: dict[str, int] = {}
    for entry in inflight.values():
        if now - entry.at > INFLIGHT_FRESH_SECONDS:
            continue
        total += max(0, entry.total)
        for url, count in entry.replicas.items():
            by_url[url] = by_url.get(url, 0) + max(0, count)
    return total, by_url


def _reasons(events: list[Event]) -> dict[int, str]:
    """Replica id -> the reason of the latest event naming it with one."""
    out: dict[int, str] = {}
    for event in events:
        replica, reason = event.fields.get("replica"), event.fields.get("reason")
        if replica is not None and reason and replica.isdigit():
            out[int(replica)] = reason
    return out


def _ttft(engines: Mapping[int, Mapping[str, Scalar]]) -> float | None:
    values = [
        float(v)
        for e in engines.values()
        for k in TTFT_FIELDS
        if isinstance(v := e.get(k), int | float) and not isinstance(v, bool)
    ]
    return sum(values) / len(values) if values else None


def rollout(view: ServiceView) -> JSON | None:
    """A rollout in progress: replicas of the latest version vs the others (live ones),
    or None when every live replica is of the latest version and it alone serves."""
    live = [r for r in view.replicas if ReplicaStatus(r.status) not in GONE]
    old = [r for r in live if r.version != view.version]
    if not old and view.active_versions in ([view.version], []):
        return None
    new = [r for r in live if r.version == view.version]
    ready_new = sum(1 for r in new if r.status == ReplicaStatus.READY)
    ready_old = sum(1 for r in old if r.status == ReplicaStatus.READY)
    target = view.target if view.target is not None else max(len(new), 1)
    return {
        "version": view.version,
        "old_versions": sorted({r.version for r in old}),
        "new_ready": ready_new,
        "new_total": len(new),
        "old_ready": ready_old,
        "old_total": len(old),
        "target": target,
        "active_versions": list(view.active_versions),
    }


def fleet_row(reading: Reading, now: float) -> JSON:
    """One service on the fleet page."""
    view = reading.view
    total, _ = inflight_by_url(reading.inflight, now)
    versions: dict[str, int] = {}
    for replica in view.replicas:
        if ReplicaStatus(replica.status) not in GONE:
            versions[str(replica.version)] = versions.get(str(replica.version), 0) + 1
    return {
        "name": view.name,
        "status": view.status,
        "version": view.version,
        "active_versions": list(view.active_versions),
        "versions": versions,
        "ready": view.ready,
        "total": view.total,
        "endpoint": view.endpoint,
        "rps": requests_per_second(reading.rps, now),
        # 5xx + cut responses per second, from the proxies' heartbeats (None: no proxy
        # that reports them; the page says n/a).
        "errors_per_s": _rounded(reading.rates.errors_per_s),
        "inflight": total,
        "rollout": rollout(view),
        "last_failure": view.last_failure,
    }


def service_doc(reading: Reading, now: float) -> JSON:
    """The service page: `sluice status --json`'s view plus what the page adds."""
    doc: JSON = msgspec.to_builtins(reading.view)
    total, by_url = inflight_by_url(reading.inflight, now)
    reasons = _reasons(reading.events)
    for replica in doc["replicas"]:
        rid, url = replica["id"], replica.get("url")
        replica["inflight"] = by_url.get(url, 0) if url else 0
        replica["reason"] = reasons.get(rid)
        launched = replica.get("launched_at")
        replica["age"] = max(0.0, now - launched) if launched else None
        engine = reading.engines.get(rid)
        if engine and is_engine(engine):
            replica["engine"] = engine
    doc["now"] = now
    doc["rps"] = requests_per_second(reading.rps, now)
    doc["inflight"] = total
    doc["errors_per_s"] = _rounded(reading.rates.errors_per_s)
    doc["rollout"] = rollout(reading.view)
    doc["events"] = [
        {"id": e.id, "kind": e.kind, "at": e.at, "fields": e.fields} for e in reading.events
    ]
    return doc


def sample(reading: Reading, now: float) -> JSON:
    """One point of the service's charts."""
    view = reading.view
    states: dict[str, int] = {}
    for replica in view.replicas:
        states[replica.status] = states.get(replica.status, 0) + 1
    total, _ = inflight_by_url(reading.inflight, now)
    return {
        "t": now,
        "rps": requests_per_second(reading.rps, now),
        "inflight": total,
        "states": states,
        "ttft": _ttft(reading.engines),
        "errors": _rounded(reading.rates.errors_per_s),
        "routed": None if reading.rates.routed is None else {
            reason: round(rate, 2) for reason, rate in reading.rates.routed.items()},
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
