"""What the ops commands do: `up`, `update`, `down` (of services or one replica),
`replica add|remove|preempt`, `status`.

They talk to Redis only (through `Store`) and nudge the controller, which does
the work: launching, probing, draining, terminating. Every write is a
read-modify-write `Store.commit_with`, so an ops command racing the controller
never overwrites what the controller just wrote, and vice versa.

Errors (besides the store's ServiceNotFound / ServiceExists / StoreUnavailable):

    OpsError
    ├── ServiceShuttingDown   the service is being taken down; it takes no changes
    ├── ReplicaExists         `add_replica` of a URL the service already routes to
    ├── ReplicaNotFound       `remove_replica` of a URL it has no external replica for,
    │                         `preempt_replica` / `terminate_replica` of an unknown id
    └── ReplicaBusy           `terminate_replica` of one shutting down, or failed
                              without `purge`
"""

from __future__ import annotations

import asyncio
import fnmatch
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from controlplane.autoscaler import Autoscaler
from controlplane.backends.local import check_fixed_port
from controlplane.backends.skypilot import infra_text, resources_text
from controlplane.records import AutoscalerStatus, ReplicaRecord, ServiceRecord, check_service_name
from controlplane.rollout import given_up_by, ready_version
from controlplane.spec import ServiceSpec
from controlplane.states import (
    FAILED_REPLICA_STATUSES,
    GONE,
    EventKind,
    ReplicaStatus,
    ServiceStatus,
    UpdateMode,
)
from controlplane.store import Mutation, ServiceNotFound, Store
from proxy.wire.errors import SluiceError


class OpsError(SluiceError):
    """An ops command refused: the message says why."""


class ServiceShuttingDown(OpsError):
    """The service is shutting down; it takes no updates or replicas."""


class ReplicaExists(OpsError):
    """The service already has a live replica at that URL."""


class ReplicaNotFound(OpsError):
    """The service has no external replica at that URL."""


class ReplicaBusy(OpsError):
    """The replica cannot be taken down now (shutting down, or failed without purge)."""


class ReplicaView(msgspec.Struct, frozen=True, kw_only=True):
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
    replicas: list[ReplicaView]
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


async def up(
    store: Store, name: str, spec: ServiceSpec, *, endpoint: str | None = None
) -> ServiceRecord:
    """Register service `name` at version 1 with `spec` and nudge the controller.

    `endpoint` is where clients reach it (the proxy's URL), shown by `status`.
    Returns the stored record. Raises ServiceExists if the name is taken,
    ValueError (InvalidServiceName) for an invalid name, before touching Redis;
    PortConflict for local replicas that would share a fixed port.
    """
    check_service_name(name)
    check_fixed_port(spec)
    record = ServiceRecord(
        name=name,
        status=ServiceStatus.CONTROLLER_INIT,
        version=1,
        update_mode=UpdateMode.ROLLING,
        policy=spec.service.load_balancing_policy,
        prefix_options=spec.prefix_options,
        endpoint=endpoint,
        min_replicas={1: spec.min_replicas},
    )
    await store.register_service(record, spec.to_json())
    await store.append_event(name, EventKind.UP, {"version": 1})
    await store.nudge(name)
    stored = await store.service(name)
    if stored is None:  # taken down between the two calls
        raise ServiceNotFound(f"no service {name!r}")
    return stored


async def update(
    store: Store, name: str, spec: ServiceSpec, *, mode: UpdateMode | None = None
) -> int:
    """Make `spec` the latest version of service `name`; returns the new version.

    The spec and the version bump are written in one transaction; the
    controller then relabels (count-only change) or rolls out new replicas
    (`mode`: rolling or blue_green; default: the service's current mode).
    Raises ServiceNotFound, ServiceShuttingDown, PortConflict (a new local replica
    would need the fixed port the running one holds).
    """
    current_raw = await store.spec(name, (await _record(store, name)).version)
    check_fixed_port(spec, ServiceSpec.from_json(current_raw) if current_raw else None)
    payload = spec.to_json()

    def plan(current: ServiceRecord, _replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, int]:
        if current.status is ServiceStatus.SHUTTING_DOWN:
            raise ServiceShuttingDown(f"service {name!r} is shutting down")
        new_version = current.version + 1
        record = msgspec.structs.replace(
            current,
            version=new_version,
            update_mode=mode if mode is not None else current.update_mode,
            policy=spec.service.load_balancing_policy,
            prefix_options=spec.prefix_options,
            min_replicas={**current.min_replicas, new_version: spec.min_replicas},
        )
        return Mutation(service_record=record, specs={new_version: payload}), new_version

    new_version = (await store.commit_with(name, plan)).result
    fields: dict[str, str | int | float] = {"version": new_version}
    if mode is not None:
        fields["mode"] = mode.value
    await store.append_event(name, EventKind.UPDATE, fields)
    await store.nudge(name)
    return new_version


async def match_services(store: Store, patterns: list[str]) -> list[str]:
    """The services named by `patterns` (exact names or globs: `*`, `?`, `[...]`), sorted,
    each once. Raises ServiceNotFound naming the first pattern that matches nothing
    (before anything is done to any of them)."""
    names = await store.services()
    chosen: set[str] = set()
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            found = fnmatch.filter(names, pattern)
        else:
            found = [pattern] if pattern in names else []
        if not found:
            what = " matches" if any(c in pattern for c in "*?[") else ""
            raise ServiceNotFound(f"no service{what} {pattern!r}")
        chosen.update(found)
    return sorted(chosen)


async def down(store: Store, name: str, *, purge: bool = False) -> list[ReplicaRecord]:
    """Mark service `name` SHUTTING_DOWN and nudge the controller, which drains and
    terminates every replica, then unregisters the service. Returns at once (use
    `wait_for` or poll `store.services()` to see it gone). Raises ServiceNotFound.

    `purge` (Sky Serve's `down --purge`): a service already SHUTTING_DOWN, which the
    controller could not finish (none runs, or a replica's cleanup keeps failing), is
    removed from Redis at once. Returns the replicas it still listed: their processes
    may be left running. Otherwise `purge` changes nothing and [] is returned.
    """
    if purge:
        record = await store.service(name)
        if record is None:
            raise ServiceNotFound(f"no service {name!r}")
        if record.status is ServiceStatus.SHUTTING_DOWN:
            left = [r for r in (await store.replicas(name)).values() if r.handle]
            await store.unregister_service(name)
            return left

    def plan(current: ServiceRecord, _replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, None]:
        if current.status is ServiceStatus.SHUTTING_DOWN:
            return Mutation(), None
        down = msgspec.structs.replace(current, status=ServiceStatus.SHUTTING_DOWN)
        return Mutation(service_record=down), None

    await store.commit_with(name, plan)
    await store.append_event(name, EventKind.DOWN)
    await store.nudge(name)
    return []


async def terminate_replica(
    store: Store, name: str, replica_id: int, *, purge: bool = False
) -> str:
    """Take replica `replica_id` of service `name` down (Sky Serve's `down --replica-id`).

    A live replica leaves the ready set at once (SHUTTING_DOWN); the controller drains
    and stops it (an external one is only forgotten) and, as for any replica that
    leaves, launches a replacement if the target asks for one. A failed replica is
    refused unless `purge`, which removes its record (and so lets a version it had
    given up launch again). Returns "terminated" or "purged". Raises ServiceNotFound,
    ReplicaNotFound, ReplicaBusy.
    """

    def plan(current: ServiceRecord, replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, str]:
        replica = replicas.get(replica_id)
        if replica is None:
            raise ReplicaNotFound(f"service {name!r} has no replica {replica_id}")
        if replica.status is ReplicaStatus.SHUTTING_DOWN:
            raise ReplicaBusy(f"replica {replica_id} of {name!r} is already shutting down")
        action = "terminated"
        if replica.status in FAILED_REPLICA_STATUSES or replica.status is ReplicaStatus.PREEMPTED:
            if not purge:
                raise ReplicaBusy(
                    f"replica {replica_id} of {name!r} is in failed status "
                    f"({replica.status.value}); use --purge to remove it"
                )
            action = "purged"
            if not replica.handle:  # nothing left to stop: forget it now
                return Mutation(replica_deletes=(replica_id,)), action
        # No timestamp: the controller stamps status_since with its own clock.
        leaving = msgspec.structs.replace(
            replica, status=ReplicaStatus.SHUTTING_DOWN, status_since=None
        )
        return Mutation(replica_updates=(leaving,)), action

    action = (await store.commit_with(name, plan)).result
    await store.append_event(name, EventKind.DRAIN, {"replica": replica_id, "reason": action})
    await store.nudge(name)
    return action


async def add_replica(
    store: Store,
    name: str,
    url: str,
    *,
    accelerator: str | None = None,
    spot: bool = False,
) -> int:
    """Register an external replica at `url` (http(s)://host:port) with service `name`.

    The controller probes it and routes to it once READY; it never launches or
    kills it. External replicas are routed in addition to the replicas the
    controller launches, and are relabelled to the latest version on every
    update. Returns the new replica id. Raises ServiceNotFound,
    ServiceShuttingDown, ReplicaExists, ValueError for an invalid URL.
    """
    url = url.rstrip("/")
    spec_raw = await store.spec(name, (await _record(store, name)).version)
    target_qps = None
    if spec_raw is not None:
        spec = ServiceSpec.from_json(spec_raw)
        target_qps = spec.service.scaling.target_qps_for(accelerator)

    def plan(current: ServiceRecord, replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, int]:
        if current.status is ServiceStatus.SHUTTING_DOWN:
            raise ServiceShuttingDown(f"service {name!r} is shutting down")
        for replica in replicas.values():
            if replica.url == url and replica.status not in GONE:
                raise ReplicaExists(f"service {name!r} already has replica {replica.id} at {url}")
        replica_id = max(current.next_replica_id, max(replicas, default=0) + 1)
        # No timestamps: the controller stamps launched_at and status_since with its own
        # clock (the initial delay and the drain are timed there, not on this machine).
        replica = ReplicaRecord(
            id=replica_id,
            status=ReplicaStatus.STARTING,
            version=current.version,
            url=url,
            backend="external",
            spot=spot,
            accelerator=accelerator,
            target_qps=target_qps,
        )
        record = msgspec.structs.replace(current, next_replica_id=replica_id + 1)
        return Mutation(replica_updates=(replica,), service_record=record), replica_id

    replica_id = (await store.commit_with(name, plan)).result
    added: dict[str, str | int | float] = {"replica": replica_id, "url": url}
    await store.append_event(name, EventKind.LAUNCH, {**added, "backend": "external"})
    await store.nudge(name)
    return replica_id


async def remove_replica(store: Store, name: str, url: str) -> None:
    """Take the external replica at `url` out of service `name`.

    It leaves the ready set at once (SHUTTING_DOWN); the controller forgets it
    after the drain delay (timed from when it sees the change). It is never
    killed. Raises ServiceNotFound, ReplicaNotFound.
    """
    url = url.rstrip("/")

    def plan(current: ServiceRecord, replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, int]:
        for replica in replicas.values():
            if replica.url == url and replica.backend == "external":
                if replica.status is ReplicaStatus.SHUTTING_DOWN:
                    return Mutation(), replica.id
                drained = msgspec.structs.replace(
                    replica, status=ReplicaStatus.SHUTTING_DOWN, status_since=None
                )
                return Mutation(replica_updates=(drained,)), replica.id
        raise ReplicaNotFound(f"service {name!r} has no external replica at {url}")

    removed = (await store.commit_with(name, plan)).result
    drained: dict[str, str | int | float] = {"replica": removed, "url": url}
    await store.append_event(name, EventKind.DRAIN, {**drained, "reason": "removed"})
    await store.nudge(name)


async def preempt_replica(store: Store, name: str, replica_id: int) -> None:
    """Simulate the preemption of replica `replica_id` of service `name` (spot testing).

    The replica becomes PREEMPTED in one commit, so it leaves the ready set at
    once; the controller terminates it and launches a replacement (and, with
    dynamic_ondemand_fallback, an on-demand replica until a spot one is READY
    again). Raises ServiceNotFound, ReplicaNotFound (no such replica, or it is
    already failed, preempted or shutting down).
    """

    def plan(current: ServiceRecord, replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, None]:
        replica = replicas.get(replica_id)
        if replica is None or replica.status in GONE:
            raise ReplicaNotFound(f"service {name!r} has no live replica {replica_id}")
        # No timestamp: the controller stamps status_since with its own clock.
        preempted = msgspec.structs.replace(
            replica, status=ReplicaStatus.PREEMPTED, status_since=None
        )
        return Mutation(replica_updates=(preempted,)), None

    await store.commit_with(name, plan)
    await store.append_event(name, EventKind.PREEMPT, {"replica": replica_id})
    await store.nudge(name)


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


# -- internals -------------------------------------------------------------------------------



async def _record(store: Store, name: str) -> ServiceRecord:
    record = await store.service(name)
    if record is None:
        raise ServiceNotFound(f"no service {name!r}")
    return record


async def _proxies(store: Store, name: str, generation: int, lag: LagLimits) -> list[ProxyView]:
    beats = await store.read_proxies(name)
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
    last_failure = None
    for event in reversed(await store.events(name, count=200)):
        if event.kind == EventKind.FAILURE:
            last_failure = event.fields.get("reason", "failed")
            break
    blocked = given_up_by(replicas, record.version, ready_version(record, replicas))
    launch_blocked = None
    if blocked is not None:
        launch_blocked = (
            f"version {record.version} stopped launching: replica {blocked.id} "
            f"{blocked.status.value} before it was ever ready"
        )
        if last_failure:
            launch_blocked += f" ({last_failure})"
    autoscaling = None
    target = None
    spec_raw = await store.spec(name, record.version)
    if spec_raw is not None:
        policy = ServiceSpec.from_json(spec_raw).service.scaling
        autoscaling = Autoscaler(policy, now=0.0).describe()
        target = policy.min_replicas
    decision = await store.read_autoscaler(name)
    if decision is not None:
        target = decision.target
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
        replicas=[
            ReplicaView(
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
            )
            for r in replicas
        ],
        last_failure=last_failure,
        launch_blocked=launch_blocked,
        autoscaling=autoscaling,
        target=target,
        autoscaler=decision,
        proxies=await _proxies(store, name, state.generation, lag),
    )
