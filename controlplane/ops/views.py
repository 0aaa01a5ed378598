"""What `sluice status` shows: `ServiceView` (with its `ReplicaStatusView`s and
`ProxyView`s), built from one consistent read of the service (`status`), and
`wait_for`, which polls it until a condition holds. Read-only: nothing here writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from controlplane.autoscaler import Autoscaler
from controlplane.backends.skypilot_task import infra_text, resources_text
from controlplane.records import AutoscalerStatus, ReplicaRecord, ServiceRecord
from controlplane.rollout import given_up_by, ready_version
from controlplane.servicespec import ServiceSpec
from controlplane.states import GONE, EventKind, ReplicaStatus
from controlplane.store import ServiceNotFound, Store
from proxy.wire.engines import EngineStats


class ReplicaStatusView(msgspec.Struct, frozen=True, kw_only=True):
    """One replica as `sluice status` shows it."""

    id: int
    version: int
    url: str | None
    status: str
    backend: str
    launched_at: float | None
    first_ready_at: float | None
    accelerator: str | None = None
    spot: bool = False
    infra: str | None = None  # where it runs, e.g. "AWS (us-east-1, us-east-1a)"; "local"
    resources: str | None = None  # e.g. "1x[Spot](g6.xlarge, L4:1) $0.40/h" (SkyPilot)
    # Why it failed, was preempted or is not ready (its latest such event), e.g.
    # "replica 2 (v1): process exited with code 3 ..."; None when there was none.
    reason: str | None = None
    log: str | None = None  # the local backend's log file of the replica
    # SHUTTING_DOWN after being READY: draining since `status_since`, with `inflight`
    # requests the proxies report on it (fresh reports only); None otherwise.
    draining_since: float | None = None
    inflight: int | None = None


class ProxyView(msgspec.Struct, frozen=True, kw_only=True):
    """One proxy process (its heartbeat) as `sluice status` shows it.

    `lag_generations` is how many commits it is behind the generation in Redis;
    `lag_seconds` how long the newest commit it has not applied has been published
    (0 when up to date). `lagging` when either is over the status thresholds, or
    its heartbeat is older than the seconds threshold (it stopped reporting)."""

    id: str
    generation: int
    applied_at: float
    seen_at: float
    connected: bool
    lag_generations: int
    lag_seconds: float
    lagging: bool


@dataclass(frozen=True)
class LagLimits:
    """When `sluice status` flags a proxy: more than `generations` behind, or behind
    (or silent) for more than `seconds`."""

    generations: int = 2
    seconds: float = 5.0


class ServiceView(msgspec.Struct, frozen=True, kw_only=True):
    """One service as `sluice status` shows it (Sky Serve's columns and a bit more).

    `ready` counts READY replicas; `total` counts replicas that are neither
    failed nor shutting down. `uptime` is seconds since the service was created.
    `last_failure` is the reason of the latest failure event; `launch_blocked`
    says why the controller stopped launching replicas of the latest version
    (None when it has not).
    """

    name: str
    status: str
    version: int
    active_versions: list[int]
    update_mode: str
    policy: str
    endpoint: str | None
    created_at: float
    uptime: float
    ready: int
    total: int
    generation: int
    replicas: list[ReplicaStatusView]
    last_failure: str | None = None
    launch_blocked: str | None = None
    # The replica policy in words (`Autoscaler.describe()`), the replicas the
    # controller wants of the latest version, and its last autoscaling decision
    # (None until it made one: fixed services, or no controller yet).
    autoscaling: str | None = None
    target: int | None = None
    autoscaler: AutoscalerStatus | None = None
    # Every live proxy process's heartbeat (sorted by id), with its lag.
    proxies: list[ProxyView] = []
    # Each READY replica's engine telemetry as the controller last published it
    # (replica id as a string -> record; empty without a controller or metrics).
    engines: dict[str, EngineStats] = {}


async def status(
    store: Store, name: str | None = None, *, lag: LagLimits | None = None
) -> list[ServiceView]:
    """Views of service `name`, or of every service (sorted by name) when None; proxies
    lagging beyond `lag` (default LagLimits()) are flagged.

    Raises ServiceNotFound when `name` is given and not registered.
    """
    names = [name] if name is not None else await store.services()
    views = []
    for service in names:
        view = await _view(store, service, lag or LagLimits())
        if view is None:
            if name is not None:
                raise ServiceNotFound(f"no service {name!r}")
            continue  # removed since the listing
        views.append(view)
    return views


async def wait_for(
    store: Store,
    name: str,
    predicate: Callable[[ServiceView], bool],
    timeout: float,  # noqa: ASYNC109 (the CLI passes a number)
    *,
    interval: float = 0.05,
) -> ServiceView:
    """Poll `status(name)` until `predicate(view)` holds; return that view.

    While the service is not registered the predicate is not called. Raises
    TimeoutError (with the last view in the message) after `timeout` seconds.
    """
    last: ServiceView | None = None
    try:
        async with asyncio.timeout(timeout):
            while True:
                last = await _view(store, name, LagLimits())
                if last is not None and predicate(last):
                    return last
                await asyncio.sleep(interval)
    except TimeoutError:
        raise TimeoutError(
            f"service {name!r}: condition not met in {timeout}s; last: {last}"
        ) from None


async def _proxies(store: Store, name: str, generation: int, lag: LagLimits) -> list[ProxyView]:
    beats = await store.telemetry.read_proxies(name)
    if not beats:
        return []
    snapshot = await store.snapshot(name)
    published_at = snapshot.published_at if snapshot is not None else 0.0
    now = time.time()
    views = []
    for proxy_id, beat in beats.items():
        behind = max(0, generation - beat.generation)
        lag_seconds = max(0.0, now - published_at) if behind else 0.0
        silent = now - beat.seen_at > lag.seconds
        views.append(ProxyView(
            id=proxy_id,
            generation=beat.generation,
            applied_at=beat.applied_at,
            seen_at=beat.seen_at,
            connected=beat.connected,
            lag_generations=behind,
            lag_seconds=lag_seconds,
            lagging=behind > lag.generations or lag_seconds > lag.seconds or silent,
        ))
    return views


async def _view(store: Store, name: str, lag: LagLimits) -> ServiceView | None:
    state = await store.read_state(name)
    if state is None:
        return None
    record = state.record
    replicas = list(state.replicas.values())
    last_failure, reasons = await _failures(store, name)
    autoscaling, target, no_run = await _policy(store, record)
    decision = await store.telemetry.read_autoscaler(name)
    if decision is not None:
        target = decision.target
    draining = await _draining(store, name, replicas)
    engines = await store.telemetry.read_engines(name)
    return ServiceView(
        name=record.name,
        status=record.status.value,
        version=record.version,
        active_versions=list(record.active_versions),
        update_mode=record.update_mode.value,
        policy=record.policy,
        endpoint=record.endpoint,
        created_at=record.created_at,
        uptime=max(0.0, time.time() - record.created_at),
        ready=sum(1 for r in replicas if r.status is ReplicaStatus.READY),
        total=sum(1 for r in replicas if r.status not in GONE),
        generation=state.generation,
        replicas=[_replica_view(r, reasons.get(r.id), draining) for r in replicas],
        last_failure=last_failure,
        launch_blocked=_launch_blocked(record, replicas, reasons) or no_run,
        autoscaling=autoscaling,
        target=target,
        autoscaler=decision,
        proxies=await _proxies(store, name, state.generation, lag),
        engines=dict(engines.replicas) if engines else {},
    )


#: Events that carry why a replica left READY or never got there.
_REASON_EVENTS = (EventKind.FAILURE, EventKind.NOT_READY, EventKind.PREEMPT)


async def _failures(store: Store, name: str) -> tuple[str | None, dict[int, str]]:
    """The reason of the latest failure event among the last 200 events, and the latest
    reason (failure, not ready, preemption) per replica id."""
    last: str | None = None
    reasons: dict[int, str] = {}
    for event in await store.events(name, count=200):
        if event.kind not in _REASON_EVENTS:
            continue
        reason = event.fields.get("reason")
        if event.kind == EventKind.FAILURE:
            last = reason or "failed"
        with contextlib.suppress(KeyError, ValueError):
            if reason:
                reasons[int(event.fields["replica"])] = reason
    return last, reasons


def _launch_blocked(
    record: ServiceRecord, replicas: list[ReplicaRecord], reasons: dict[int, str]
) -> str | None:
    """Why the controller stopped launching replicas of the latest version, if it did:
    the replica that gave it up, with that replica's own reason."""
    blocked = given_up_by(replicas, record.version, ready_version(record, replicas))
    if blocked is None:
        return None
    why = (
        f"version {record.version} stopped launching: replica {blocked.id} "
        f"{blocked.status.value} before it was ever ready"
    )
    if blocked.id in reasons:
        why += f" ({reasons[blocked.id]})"
    return why


async def _policy(store: Store, record: ServiceRecord) -> tuple[str | None, int | None, str | None]:
    """The latest version's replica policy in words, its fixed target, and why nothing is
    launched when its spec has no `run` command (replicas come from `replica add`)."""
    spec_raw = await store.spec(record.name, record.version)
    if spec_raw is None:
        return None, None, None
    spec = ServiceSpec.from_json(spec_raw)
    policy = spec.service.scaling
    no_run = None
    if not spec.run and spec.max_replicas > 0:
        no_run = (
            f"version {record.version} has no `run` command: the controller launches no "
            f"replica; register them with `sluice replica add {record.name} URL`"
        )
    return Autoscaler(policy, now=0.0).describe(), policy.min_replicas, no_run


#: An in-flight report older than this (by the proxy's clock) is not counted in status.
_INFLIGHT_FRESH_SECONDS = 5.0


async def _draining(store: Store, name: str, replicas: list[ReplicaRecord]) -> dict[int, int]:
    """Replica id -> requests in flight on it, for the replicas that drain."""
    urls = {r.id: r.url for r in replicas
            if r.status is ReplicaStatus.SHUTTING_DOWN and r.first_ready_at and r.url}
    if not urls:
        return {}
    now = time.time()
    fresh = [e for e in (await store.telemetry.read_inflight(name)).values()
             if now - e.at <= _INFLIGHT_FRESH_SECONDS]
    return {i: sum(max(0, e.replicas.get(url, 0)) for e in fresh) for i, url in urls.items()}


def _replica_view(
    r: ReplicaRecord, reason: str | None = None, draining: dict[int, int] | None = None
) -> ReplicaStatusView:
    inflight = (draining or {}).get(r.id)
    return ReplicaStatusView(
        draining_since=r.status_since if inflight is not None else None,
        inflight=inflight,
        id=r.id,
        version=r.version,
        url=r.url,
        status=r.status.value,
        backend=r.backend,
        launched_at=r.launched_at,
        first_ready_at=r.first_ready_at,
        accelerator=r.accelerator,
        spot=r.spot,
        infra=infra_text(r.handle) if r.backend == "skypilot" else r.backend,
        resources=resources_text(r.handle) if r.backend == "skypilot" else None,
        reason=reason,
        log=logged if isinstance(logged := r.handle.get("log"), str) else None,
    )
