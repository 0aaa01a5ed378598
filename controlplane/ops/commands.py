"""The ops commands that write: `up`, `update`, `down` (of services or one
replica), `replica add|remove|preempt`.

They talk to Redis only (through `Store`) and nudge the controller, which does
the work: launching, probing, draining, terminating. Every write is a
read-modify-write `Store.commit_with`, so an ops command racing the controller
never overwrites what the controller just wrote, and vice versa. What a command
does to a replica is `controlplane.lifecycle`'s. Errors: `ops.errors`.
"""

from __future__ import annotations

import fnmatch

import msgspec

from controlplane import lifecycle
from controlplane.backends.fit import check_backend
from controlplane.ops.errors import ReplicaBusy, ReplicaExists, ReplicaNotFound, ServiceShuttingDown
from controlplane.records import ReplicaRecord, ServiceRecord, check_service_name
from controlplane.servicespec import ServiceSpec
from controlplane.states import (
    FAILED_REPLICA_STATUSES,
    GONE,
    EventKind,
    ReplicaStatus,
    ServiceStatus,
    UpdateMode,
)
from controlplane.store import Mutation, ServiceNotFound, Store


async def up(
    store: Store,
    name: str,
    spec: ServiceSpec,
    *,
    endpoint: str | None = None,
    backend: str = "local",
) -> ServiceRecord:
    """Register service `name` at version 1 with `spec` and nudge the controller.

    `endpoint` is where clients reach it (the proxy's URL), shown by `status`.
    Returns the stored record. Raises ServiceExists if the name is taken,
    ValueError (InvalidServiceName) for an invalid name, before touching Redis;
    backends.fit.Unfit / PortConflict when `backend` (the controller's) cannot run it.
    """
    check_service_name(name)
    check_backend(spec, backend)
    record = ServiceRecord(
        name=name,
        status=ServiceStatus.CONTROLLER_INIT,
        version=1,
        update_mode=UpdateMode.ROLLING,
        policy=spec.service.load_balancing_policy,
        prefix_options=spec.prefix_options,
        resume_streams=spec.resume_streams,
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
    store: Store,
    name: str,
    spec: ServiceSpec,
    *,
    mode: UpdateMode | None = None,
    backend: str = "local",
) -> int:
    """Make `spec` the latest version of service `name`; returns the new version.

    The spec and the version bump are written in one transaction; the
    controller then relabels (count-only change) or rolls out new replicas
    (`mode`: rolling or blue_green; default: the service's current mode).
    Raises ServiceNotFound, ServiceShuttingDown, PortConflict (a new local replica
    would need the fixed port the running one holds).
    """
    current_raw = await store.spec(name, (await _record(store, name)).version)
    check_backend(spec, backend, ServiceSpec.from_json(current_raw) if current_raw else None)
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
            resume_streams=spec.resume_streams,
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
        return Mutation(replica_updates=(lifecycle.taken_down(replica),)), action

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
        replica = lifecycle.external_replica(
            replica_id, current.version, url,
            spot=spot, accelerator=accelerator, target_qps=target_qps,
        )  # fmt: skip
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
                drained = lifecycle.taken_down(replica)
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
        return Mutation(replica_updates=(lifecycle.preempted_by_ops(replica),)), None

    await store.commit_with(name, plan)
    await store.append_event(name, EventKind.PREEMPT, {"replica": replica_id})
    await store.nudge(name)


async def _record(store: Store, name: str) -> ServiceRecord:
    record = await store.service(name)
    if record is None:
        raise ServiceNotFound(f"no service {name!r}")
    return record
