"""The controller: reconciles every service in Redis towards its spec.

`Controller.step()` reconciles each service once; `Controller.run()` calls it
whenever something happens (a nudge on the control channel, a probe result, a
launch or termination finishing, a drain or probe falling due) and at least
every `reconcile_interval`. `run_controller()` adds the leader lease: it
stands by until it holds the lease, leads while it keeps it, and stands by
again if it loses it. Time comes from one injectable clock.

One step of one service, planned on a consistent read (`Store.read_state`)
and written in ONE `Store.commit_with` (nothing written when nothing changed):

1. finished launches: PROVISIONING -> STARTING with the backend's URL and handle
   (or FAILED_PROVISION); finished terminations: the record is deleted;
2. liveness: a replica whose process is gone -> FAILED;
3. probe results (`controlplane.prober`): READY / NOT_READY / FAILED_*;
4. relabel: live replicas of an older version whose spec differs from the
   latest only in relabel-safe fields (`spec.is_count_only_change`), and
   every external replica, become the latest version. In the same commit the
   active versions are recomputed, so the ready set never passes through a
   state where nobody serves;
5. scale and roll out: the service's autoscaler (`controlplane.scaling`) is
   brought up to date (a decision when one is due, a reset after an update, a
   scale from zero on a proxy's "demand" nudge); launch latest-version replicas
   up to its target (split into spot and on-demand ones by
   `autoscaler.fallback_plan` when the spec uses spot); retire old-version
   replicas as new ones become READY
   (rolling: one old per new READY one; blue_green: all at once when the new
   version has min_replicas READY); retire surplus ones in scale-down order
   (earliest state, older version, larger id first; instance-aware: lowest
   capacity before larger id). Launching stops for a version that never
   had a READY replica once one of its replicas failed for good before it
   was ever ready (`rollout.gives_up_version`, Sky Serve's rule);
6. drain and clean up: a retired replica is SHUTTING_DOWN (out of the ready
   set) for `drain_seconds` (no drain if it never was READY), then terminated
   and its record deleted; failed and PREEMPTED replicas are terminated at once
   (and replaced by step 5, since they no longer count). A service
   marked SHUTTING_DOWN by `ops.down` is unregistered when no replica is left;
7. the service status (READY, REPLICA_INIT, NO_REPLICA, FAILED).

The commit is all-or-nothing and optimistic: if an ops command wrote the
service record or a replica the plan touches since the read, nothing is
written and the service is planned again from a fresh read. Side effects
(launches, terminations, events) happen only after the commit succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from controlplane.autoscaler import (
    DECISION_INTERVAL_SECONDS,
    NO_REPLICA_DECISION_INTERVAL_SECONDS,
    QPS_WINDOW_SECONDS,
    fallback_plan,
)
from controlplane.backends.base import (
    ClusterBackend,
    Launched,
    LaunchFailed,
    ReplicaBackend,
    TaskFailed,
)
from controlplane.backends.external import ExternalBackend
from controlplane.backends.local import LocalBackend
from controlplane.prober import Prober, ProbeResult, Transition, apply_exit, apply_probe
from controlplane.records import Handle, ReplicaRecord, ServiceRecord
from controlplane.rollout import (
    accelerator_of,
    given_up_by,
    gives_up_version,
    plan_rollout,
    ready_version,
    service_status,
)
from controlplane.scaling import Scaling
from controlplane.spec import ReadinessProbe, ServiceSpec, is_count_only_change
from controlplane.states import (
    FAILED_REPLICA_STATUSES,
    LIVE,
    PROBED,
    EventKind,
    ReplicaStatus,
    ServiceStatus,
)
from controlplane.store import (
    LeaseLost,
    Mutation,
    Store,
    StoreError,
    StoreUnavailable,
)
from proxy.wire.keys import DEFAULT_PREFIX

log = logging.getLogger("sluice.controller")

_MAX_REPLANS = 5


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Everything the controller needs, built once by the CLI (or a test).

    `state_dir` holds replica logs and handle files (`{state_dir}/{service}/`).
    `drain_seconds`: how long a retired replica keeps running after it left the
    ready set. `lease_ttl`: the leader lease's TTL (renewed every third of it).
    `holder`: this controller's name in the lease (default host:pid); a random
    token is appended per process, so the lease value is unique.
    `reconcile_interval`: the longest a controller goes without a step.
    `term_timeout`: SIGTERM to SIGKILL for local replicas. `replica_env`: the host
    environment whose allow-listed variables local replicas get (None: the
    controller's own; see backends/local.py).
    `base_dir`: what a spec's relative `workdir` is relative to (None: cwd).
    `terminate_on_close`: stop every replica when the controller closes
    (`sluice run`); otherwise replicas outlive it and the next one adopts them.
    `backend`: the backend new replicas are launched with.
    `autoscaler_interval` / `autoscaler_zero_interval`: seconds between autoscaling
    decisions (while the target is 0); `qps_window_seconds`: what QPS is averaged
    over. Sky Serve's values by default; tests shorten them.
    """

    redis_url: str
    redis_ca_file: str | None = None  # the CA of a rediss:// server (None: the system's)
    prefix: str = DEFAULT_PREFIX
    state_dir: Path
    drain_seconds: float = 120.0
    lease_ttl: float = 10.0
    holder: str | None = None
    reconcile_interval: float = 1.0
    term_timeout: float = 10.0
    replica_env: Mapping[str, str] | None = None
    base_dir: Path | None = None
    terminate_on_close: bool = False
    backend: str = "local"
    autoscaler_interval: float = DECISION_INTERVAL_SECONDS
    autoscaler_zero_interval: float = NO_REPLICA_DECISION_INTERVAL_SECONDS
    qps_window_seconds: int = QPS_WINDOW_SECONDS


class ReadinessProber(Protocol):
    """What the controller needs from a prober (`controlplane.prober.Prober`)."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def poll(
        self,
        service: str,
        replicas: list[tuple[ReplicaRecord, ReadinessProbe]],
        now: float,
    ) -> dict[int, ProbeResult]: ...

    def forget_service(self, service: str) -> None: ...

    def next_due(self, service: str, replica_id: int, interval: float) -> float | None: ...


#: (service record, latest spec, replica table, now) -> replicas of the latest version wanted.
TargetFn = Callable[[ServiceRecord, ServiceSpec, Mapping[int, ReplicaRecord], float], int]


def default_backends(config: ControllerConfig) -> dict[str, ReplicaBackend]:
    """The backends a controller runs with unless given others: local and external, and
    skypilot when it is `config.backend`."""
    backends: dict[str, ReplicaBackend] = {
        "local": LocalBackend(
            config.state_dir,
            base_env=config.replica_env,
            base_dir=config.base_dir,
            term_timeout=config.term_timeout,
        ),
        "external": ExternalBackend(),
    }
    if config.backend == "skypilot":
        from controlplane.backends.skypilot import SkyPilotBackend, SkyPilotConfig

        backends["skypilot"] = SkyPilotBackend(
            SkyPilotConfig(namespace=config.prefix, base_dir=config.base_dir)
        )
    return backends


@dataclass(frozen=True, slots=True)
class _Launch:
    task: asyncio.Task[Launched]
    backend: ReplicaBackend


class _Stale(Exception):
    """The state changed under the plan: plan again from a fresh read."""


@dataclass
class _Plan:
    """One service's step: what to write, then what to do once it is written."""

    name: str
    record: ServiceRecord  # as read
    base: dict[int, ReplicaRecord]  # the table as read
    table: dict[int, ReplicaRecord]  # the table with the plan applied so far
    now: float
    changed: set[int] = field(default_factory=set)  # ids updated or deleted
    launches: list[ReplicaRecord] = field(default_factory=list)  # ids assigned at commit
    events: list[tuple[EventKind, dict[str, str | int | float]]] = field(default_factory=list)
    terminate: list[int] = field(default_factory=list)
    status: ServiceStatus | None = None
    ready_version: int = 0  # the record's, raised when the latest version is READY
    unregister: bool = False
    # Finished tasks whose outcome this plan records; forgotten once it is committed.
    done_launches: list[int] = field(default_factory=list)
    done_terminations: list[int] = field(default_factory=list)
    orphans: list[tuple[ReplicaBackend, Launched]] = field(default_factory=list)

    def put(self, replica: ReplicaRecord) -> None:
        if self.table.get(replica.id) != replica:
            self.table[replica.id] = replica
            self.changed.add(replica.id)

    def delete(self, replica_id: int) -> None:
        if self.table.pop(replica_id, None) is not None:
            self.changed.add(replica_id)

    def event(self, kind: EventKind, **fields: str | int | float) -> None:
        self.events.append((kind, fields))

    def transition(self, t: Transition) -> None:
        self.put(t.record)
        if t.event is not None:
            fields: dict[str, str | int | float] = {
                "replica": t.record.id,
                "version": t.record.version,
                "status": t.record.status.value,
            }
            if t.reason:
                fields["reason"] = f"replica {t.record.id} (v{t.record.version}): {t.reason}"
            self.events.append((t.event, fields))

    @property
    def dirty(self) -> bool:
        return (
            bool(self.changed or self.launches)
            or (self.status is not None and self.status is not self.record.status)
            or self.ready_version != self.record.ready_version
        )


class Controller:
    """Reconciles every service in Redis; see the module docstring.

    Drive it with `step()` (tests, with an injected clock) or `run()`. The
    owner calls `start()` first and `aclose()` last; `aclose()` leaves the
    replicas running (for the next leader to adopt) unless
    `config.terminate_on_close`.
    """

    def __init__(
        self,
        store: Store,
        config: ControllerConfig,
        *,
        clock: Callable[[], float] = time.time,
        backends: Mapping[str, ReplicaBackend] | None = None,
        prober: ReadinessProber | None = None,
        target: TargetFn | None = None,
    ) -> None:
        """`target`: replicas of the latest version wanted; default: the autoscaler's
        (`controlplane.scaling`), the fixed count for services without autoscaling."""
        self.config = config
        self._store = store
        self._clock = clock
        self._backends: dict[str, ReplicaBackend] = (
            dict(backends) if backends is not None else default_backends(config)
        )
        self._prober: ReadinessProber = (
            prober if prober is not None else Prober(clock=clock, on_result=self.wake)
        )
        self._scaling = Scaling(
            store,
            interval=config.autoscaler_interval,
            zero_interval=config.autoscaler_zero_interval,
            qps_window=config.qps_window_seconds,
        )
        self._target: TargetFn = target if target is not None else self._scaling.target
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._specs: dict[tuple[str, float, int], ServiceSpec] = {}
        self._launches: dict[tuple[str, int], _Launch] = {}
        self._terminations: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._orphans: set[asyncio.Task[None]] = set()
        # Probe results not yet committed (kept across a replan).
        self._probe_results: dict[str, dict[int, ProbeResult]] = {}
        self._known: set[str] = set()
        # service -> replica id -> (backend, handle) as of the last step: what
        # terminate_all stops when Redis is gone (sluice run's dies with it).
        self._fleet: dict[str, dict[int, tuple[ReplicaBackend, Handle]]] = {}
        # Replica ids recorded per service in this step (for ClusterBackend.sweep).
        self._recorded: dict[str, set[int]] = {}
        self._deadline: float | None = None
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the backends and the prober."""
        if self._started:
            return
        for backend in self._backends.values():
            if isinstance(backend, ClusterBackend):
                backend.watch(self.wake)
            await backend.start()
        await self._prober.start()
        self._started = True

    async def aclose(self, *, stepping_down: bool = False) -> None:
        """Stop launches and terminations in flight, close the prober and backends.

        Replicas keep running unless `config.terminate_on_close`, in which case
        every replica is terminated (no drain) and its record deleted. A leader
        `stepping_down` (it lost the lease) never terminates: the fleet is the
        service's, and the next leader (possibly this one again) adopts it.
        """
        if self.config.terminate_on_close and not stepping_down:
            with contextlib.suppress(StoreError):
                await self.terminate_all()
        tasks: list[asyncio.Task[Launched] | asyncio.Task[None]] = [
            *(launch.task for launch in self._launches.values()),
            *self._terminations.values(),
            *self._orphans,
        ]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for task in tasks:  # their outcomes do not matter any more
            if not task.cancelled():
                task.exception()
        self._launches.clear()
        self._terminations.clear()
        self._orphans.clear()
        await self._prober.aclose()
        for backend in self._backends.values():
            await backend.aclose()
        self._started = False

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def wake(self) -> None:
        """Make `run()` step now (probe results, finished tasks, nudges)."""
        self._wake.set()

    def demand(self, name: str) -> None:
        """A proxy holds requests of `name` with no replica: scale it from zero at once
        (what a "demand" nudge does)."""
        self._scaling.note_demand(name)
        self.wake()

    @property
    def scaling(self) -> Scaling:
        """The per-service autoscalers (read-only use: tests, diagnostics)."""
        return self._scaling

    async def run(self) -> None:
        """Step until cancelled: on every nudge and event, at least every reconcile_interval."""
        await self.start()
        listener = asyncio.create_task(self._listen(), name="controller nudges")
        failures = 0
        try:
            while True:
                self._wake.clear()
                try:
                    await self.step()
                    failures = 0
                except (asyncio.CancelledError, LeaseLost):
                    raise  # LeaseLost: a successor leads; run_controller steps down
                except StoreUnavailable as exc:
                    failures += 1
                    log.warning("reconcile step failed: %s", exc)
                except Exception:
                    failures += 1
                    log.exception("reconcile step failed")
                if failures:
                    # Probe results keep waking the loop; do not spin on a failing Redis.
                    await asyncio.sleep(min(0.1 * 2**failures, 5.0))
                await self._idle()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def terminate_all(self) -> None:
        """Terminate every replica this controller can reach (no drain); delete the records.

        A fenced controller that no longer holds the lease terminates nothing but its
        own launches in flight: the fleet is the successor's. When Redis cannot be
        reached (`sluice run`'s private one gets SIGTERM with the controller when
        `sluice run` dies), it terminates the replicas its last steps saw.
        """
        launches = list(self._launches.values())
        self._launches.clear()
        for launch in launches:
            launch.task.cancel()
        if launches:
            await asyncio.wait([launch.task for launch in launches])
        for launch in launches:
            # A launch that finished before the cancel has a process the records miss.
            if not launch.task.cancelled() and launch.task.exception() is None:
                with contextlib.suppress(Exception):
                    await launch.backend.terminate(launch.task.result().handle)
        victims = {
            (name, replica_id): known
            for name, replicas in self._fleet.items()
            for replica_id, known in replicas.items()
        }
        records: dict[str, list[ReplicaRecord]] = {}
        try:
            fence = self._store.fence
            # Ours, or free again (it may expire while we shut down): take it for the
            # deletes below. Another's: its holder leads the fleet now.
            if fence is not None and not await self._store.acquire_lease(
                fence, self.config.lease_ttl
            ):
                log.warning("controller %s: not the leader any more; leaving the replicas", fence)
                return
            for name in await self._store.services():
                state = await self._store.read_state(name)
                if state is not None:
                    records[name] = [r for r in state.replicas.values() if r.handle]
                    for r in records[name]:
                        victims[(name, r.id)] = (self._backend(r), r.handle)
        except StoreError as exc:
            # `sluice run`'s private Redis may already be gone (both got SIGTERM when
            # `sluice run` died): stop what the last step saw.
            log.warning("terminating the %d replicas this controller knows of: %s",
                        len(victims), exc)  # fmt: skip
        await asyncio.gather(
            *(backend.terminate(handle) for backend, handle in victims.values()),
            return_exceptions=True,
        )
        self._fleet.clear()
        for name, replicas in records.items():
            with contextlib.suppress(StoreError):
                await self._store.commit(name, replica_deletes=[r.id for r in replicas])

    # -- one step ----------------------------------------------------------------------------

    async def step(self) -> None:
        """Reconcile every service once. Raises the first error after trying them all."""
        async with self._lock:
            self._deadline = None
            self._recorded = {}
            names = await self._store.services()
            first_error: Exception | None = None
            for name in names:
                try:
                    await self._reconcile(name)
                except (asyncio.CancelledError, LeaseLost):
                    raise
                except Exception as exc:
                    log.warning("service %s: reconcile failed: %s", name, exc)
                    first_error = first_error or exc
            self._forget_gone(set(names))
            if first_error is not None:
                raise first_error
            if all(name in self._recorded for name in names):
                for backend in self._backends.values():
                    if isinstance(backend, ClusterBackend):
                        backend.sweep(self._recorded)

    async def _reconcile(self, name: str) -> None:
        for _ in range(_MAX_REPLANS):
            state = await self._store.read_state(name)
            if state is None:
                self._recorded[name] = set()
                return
            self._known.add(name)
            plan = await self._plan(name, state.record, dict(state.replicas))
            try:
                launched = await self._commit(plan)
            except _Stale:
                continue  # an ops command wrote meanwhile: plan again on fresh data
            await self._after_commit(plan, launched)
            if not plan.unregister:
                self._fleet[name] = {
                    r.id: (self._backend(r), r.handle) for r in plan.table.values() if r.handle
                }
                self._recorded[name] = set(plan.table) | {r.id for r in launched}
            return
        log.warning("service %s: state kept changing; will retry next step", name)

    async def _plan(
        self, name: str, record: ServiceRecord, replicas: dict[int, ReplicaRecord]
    ) -> _Plan:
        now = self._clock()
        plan = _Plan(
            name=name,
            record=record,
            base=dict(replicas),
            table=replicas,
            now=now,
            ready_version=record.ready_version,
        )
        latest = await self._spec(record, record.version)
        specs = {record.version: latest}
        for replica in replicas.values():
            if replica.version not in specs:
                specs[replica.version] = await self._spec(record, replica.version)
        self._finished_tasks(plan)
        self._stamp(plan)
        self._liveness(plan)
        self._probe(plan, specs)
        self._relabel(plan, specs, latest)
        plan.ready_version = ready_version(record, plan.table.values())
        if record.status is ServiceStatus.SHUTTING_DOWN:
            for replica in list(plan.table.values()):
                if replica.status in LIVE:
                    self._retire(plan, replica, "down")
        else:
            managed = [r for r in plan.table.values() if self._backend(r).can_launch]
            self._due(await self._scaling.observe(record, latest, managed, now))
            self._scale(plan, latest)
        self._cleanup(plan)
        self._service_status(plan)
        return plan

    # 1. tasks that finished since the last step

    def _finished_tasks(self, plan: _Plan) -> None:
        name, now = plan.name, plan.now
        for (service, replica_id), launch in self._launches.items():
            if service != name or not launch.task.done():
                continue
            plan.done_launches.append(replica_id)
            replica = plan.table.get(replica_id)
            if launch.task.cancelled():
                continue
            exc = launch.task.exception()
            if exc is not None:
                if not isinstance(exc, LaunchFailed):
                    what = f"service {name}: launch of replica {replica_id} failed"
                    log.error(what, exc_info=exc)
                if replica is not None:
                    # The task's own failure (setup) is the user's code failing, as a
                    # process exit is; anything else is a provisioning failure, retried.
                    if isinstance(exc, TaskFailed):
                        status, reason = ReplicaStatus.FAILED, str(exc)
                    else:
                        status, reason = ReplicaStatus.FAILED_PROVISION, f"launch failed: {exc}"
                    failed = msgspec.structs.replace(replica, status=status, status_since=now)
                    plan.transition(Transition(failed, EventKind.FAILURE, reason))
                continue
            if replica is None:  # deleted meanwhile: nothing will ever route to it
                plan.orphans.append((launch.backend, launch.task.result()))
                continue
            self._started_replica(plan, replica, launch.task.result())
        for (service, replica_id), termination in self._terminations.items():
            if service != name or not termination.done():
                continue
            plan.done_terminations.append(replica_id)
            replica = plan.table.get(replica_id)
            if replica is None or termination.cancelled():
                continue
            exc = termination.exception()
            if exc is not None:
                cleanup = msgspec.structs.replace(
                    replica, status=ReplicaStatus.FAILED_CLEANUP, status_since=now
                )
                plan.transition(Transition(cleanup, EventKind.FAILURE, f"terminate failed: {exc}"))
                continue
            plan.event(EventKind.TERMINATE, replica=replica.id, version=replica.version)
            if gives_up_version(replica, plan.record.version, plan.ready_version):
                plan.put(msgspec.structs.replace(replica, handle={}))  # kept: says why
            else:
                plan.delete(replica.id)
        # Launches a dead controller began: adopt what it left, forget the rest.
        for replica in list(plan.table.values()):
            if replica.status not in (ReplicaStatus.PENDING, ReplicaStatus.PROVISIONING):
                continue
            if (name, replica.id) in self._launches:
                continue
            recovered = self._backend(replica).recover(name, replica.id)
            if recovered is not None:
                self._started_replica(plan, replica, recovered)
            else:
                plan.delete(replica.id)
                plan.event(
                    EventKind.TERMINATE,
                    replica=replica.id,
                    version=replica.version,
                    reason="launch interrupted",
                )

    def _started_replica(self, plan: _Plan, replica: ReplicaRecord, launched: Launched) -> None:
        if replica.status in (ReplicaStatus.PENDING, ReplicaStatus.PROVISIONING):
            plan.put(
                msgspec.structs.replace(
                    replica,
                    status=ReplicaStatus.STARTING,
                    url=launched.url,
                    handle=launched.handle,
                    launched_at=plan.now,
                    status_since=plan.now,
                )
            )
        else:  # retired (or failed) while launching: record the handle so it gets terminated
            plan.put(msgspec.structs.replace(replica, url=launched.url, handle=launched.handle))

    def _stamp(self, plan: _Plan) -> None:
        """Time what ops commands wrote with the controller's clock (theirs may be skewed)."""
        for replica in list(plan.table.values()):
            stamped = replica
            if stamped.status_since is None:
                stamped = msgspec.structs.replace(stamped, status_since=plan.now)
            if stamped.status is ReplicaStatus.STARTING and stamped.launched_at is None:
                stamped = msgspec.structs.replace(stamped, launched_at=plan.now)
            plan.put(stamped)

    # 2. liveness

    def _liveness(self, plan: _Plan) -> None:
        for replica in list(plan.table.values()):
            if replica.status not in PROBED or not replica.handle:
                continue
            backend = self._backend(replica)
            if replica.spot and isinstance(backend, ClusterBackend):
                why = backend.preemption(replica.handle)
                if why is not None:  # Sky Serve's rule: replaced, never counted as a failure
                    preempted = msgspec.structs.replace(
                        replica, status=ReplicaStatus.PREEMPTED, status_since=plan.now
                    )
                    plan.transition(Transition(preempted, EventKind.PREEMPT, why))
                    continue
            reason = backend.exited(replica.handle)
            if reason is not None:
                plan.transition(apply_exit(replica, reason, plan.now))

    # 3. probes

    def _probe(self, plan: _Plan, specs: dict[int, ServiceSpec]) -> None:
        targets = [
            (replica, specs[replica.version].probe)
            for replica in plan.table.values()
            if replica.status in PROBED and replica.url is not None
        ]
        results = self._probe_results.setdefault(plan.name, {})
        results.update(self._prober.poll(plan.name, targets, plan.now))
        for replica, probe in targets:
            result = results.get(replica.id)
            if result is not None:
                backend = self._backend(replica)
                if not result.ok and replica.handle and isinstance(backend, ClusterBackend):
                    backend.suspect(replica.handle)
                can_fail = backend.can_launch
                plan.transition(apply_probe(replica, result, probe, plan.now, can_fail=can_fail))
            due = self._prober.next_due(
                plan.name, replica.id, probe.endpoint_probe_interval_seconds
            )
            if due is not None:
                self._due(due)

    # 4. relabel

    def _relabel(self, plan: _Plan, specs: dict[int, ServiceSpec], latest: ServiceSpec) -> None:
        version = plan.record.version
        relabelled = []
        for replica in list(plan.table.values()):
            if replica.version >= version or replica.status not in LIVE:
                continue
            external = not self._backend(replica).can_launch
            if external or is_count_only_change(specs[replica.version], latest):
                plan.put(
                    msgspec.structs.replace(
                        replica,
                        version=version,
                        target_qps=latest.service.scaling.target_qps_for(replica.accelerator),
                    )
                )
                relabelled.append(str(replica.id))
        if relabelled:
            plan.event(EventKind.UPDATE, version=version, relabelled=",".join(relabelled))

    # 5. scale and roll out

    def _scale(self, plan: _Plan, latest: ServiceSpec) -> None:
        record = plan.record
        backend = self._backends.get(self.config.backend)
        can_launch = (
            bool(latest.run)
            and backend is not None
            and backend.can_launch
            and given_up_by(plan.table.values(), record.version, plan.ready_version) is None
        )
        managed = [r for r in plan.table.values() if self._backend(r).can_launch]
        target = self._target(record, latest, plan.table, plan.now)
        policy = latest.service.scaling
        ready_spot = sum(
            1
            for r in managed
            if r.spot and r.version == record.version and r.status is ReplicaStatus.READY
        )
        split = fallback_plan(policy, target, ready_spot, use_spot=latest.resources.use_spot)
        rollout = plan_rollout(
            record,
            managed,
            target,
            can_launch=can_launch,
            split=split,
            by_capacity=isinstance(policy.target_qps_per_replica, dict),
        )
        if rollout.launch:
            assert backend is not None
            accelerator = accelerator_of(latest)
            template = ReplicaRecord(
                id=0,  # assigned in the commit
                status=ReplicaStatus.PROVISIONING,
                version=record.version,
                backend=backend.name,
                spot=True,
                accelerator=accelerator,
                target_qps=policy.target_qps_for(accelerator),
                status_since=plan.now,
            )
            on_demand = msgspec.structs.replace(template, spot=False)
            plan.launches.extend([template] * rollout.launch_spot)
            plan.launches.extend([on_demand] * (rollout.launch - rollout.launch_spot))
        for replica, reason in rollout.retire:
            self._retire(plan, replica, reason)

    def _retire(self, plan: _Plan, replica: ReplicaRecord, reason: str) -> None:
        plan.put(
            msgspec.structs.replace(
                replica, status=ReplicaStatus.SHUTTING_DOWN, status_since=plan.now
            )
        )
        plan.event(EventKind.DRAIN, replica=replica.id, version=replica.version, reason=reason)

    # 6. drain and clean up

    def _cleanup(self, plan: _Plan) -> None:
        name, now = plan.name, plan.now
        launching = {i for s, i in self._launches if s == name} - set(plan.done_launches)
        for replica in list(plan.table.values()):
            if replica.id in launching or (name, replica.id) in self._terminations:
                continue
            if replica.status is ReplicaStatus.SHUTTING_DOWN:
                drain = self.config.drain_seconds if replica.first_ready_at is not None else 0.0
                ends = (replica.status_since or now) + drain
                exited = (
                    bool(replica.handle)
                    and self._backend(replica).exited(replica.handle) is not None
                )
                if now < ends and not exited:
                    self._due(ends)
                    continue
                if replica.handle and self._backend(replica).can_launch:
                    plan.terminate.append(replica.id)
                else:
                    plan.delete(replica.id)
                    plan.event(EventKind.TERMINATE, replica=replica.id, version=replica.version)
            elif replica.status in FAILED_REPLICA_STATUSES or (
                replica.status is ReplicaStatus.PREEMPTED
            ):
                if replica.handle and self._backend(replica).can_launch:
                    plan.terminate.append(replica.id)
                elif (
                    plan.record.status is ServiceStatus.SHUTTING_DOWN
                    or not gives_up_version(replica, plan.record.version, plan.ready_version)
                ):
                    # A version that gave up keeps its FAILED records to say why, unless
                    # the service is going away.
                    plan.delete(replica.id)
        if (
            plan.record.status is ServiceStatus.SHUTTING_DOWN
            and not plan.table
            and not plan.launches
            and not launching
        ):
            plan.unregister = True

    # 7. service status

    def _service_status(self, plan: _Plan) -> None:
        record = msgspec.structs.replace(plan.record, ready_version=plan.ready_version)
        plan.status = service_status(record, plan.table.values(), launching=bool(plan.launches))

    # -- commit and side effects -------------------------------------------------------------

    async def _commit(self, plan: _Plan) -> list[ReplicaRecord]:
        """Write the plan in one commit; returns the launched records (ids assigned)."""
        if plan.unregister:
            await self._store.unregister_service(plan.name)
            return []
        if not plan.dirty:
            return []

        def mutate(
            current: ServiceRecord, replicas: dict[int, ReplicaRecord]
        ) -> tuple[Mutation, list[ReplicaRecord]]:
            if current != plan.record:
                raise _Stale
            for replica_id in plan.changed:
                if replicas.get(replica_id) != plan.base.get(replica_id):
                    raise _Stale
            updates = [plan.table[i] for i in sorted(plan.changed) if i in plan.table]
            deletes = [i for i in sorted(plan.changed) if i not in plan.table]
            next_id = max(current.next_replica_id, max(replicas, default=0) + 1)
            launched = [msgspec.structs.replace(template, id=next_id + i)
                        for i, template in enumerate(plan.launches)]
            next_id += len(launched)
            record = msgspec.structs.replace(
                current,
                status=plan.status if plan.status is not None else current.status,
                next_replica_id=next_id,
                ready_version=max(current.ready_version, plan.ready_version),
            )
            mutation = Mutation(
                replica_updates=(*updates, *launched),
                replica_deletes=tuple(deletes),
                service_record=record,
            )
            return mutation, launched

        return (await self._store.commit_with(plan.name, mutate)).result

    async def _after_commit(self, plan: _Plan, launched: list[ReplicaRecord]) -> None:
        name = plan.name
        self._probe_results.pop(name, None)
        for replica_id in plan.done_launches:
            self._launches.pop((name, replica_id), None)
        for replica_id in plan.done_terminations:
            self._terminations.pop((name, replica_id), None)
        for backend, orphan in plan.orphans:
            self._terminate_orphan(name, backend, orphan)
        if plan.unregister:
            log.info("service %s: unregistered", name)
            self._forget(name)
            return
        # Tasks first: a replica record must never wait on an event write to get its launch.
        for replica in launched:
            spec = await self._spec(plan.record, replica.version)
            backend = self._backends[replica.backend]
            launch = (
                backend.launch(name, replica.id, replica.version, spec, spot=replica.spot)
                if isinstance(backend, ClusterBackend)
                else backend.launch(name, replica.id, replica.version, spec)
            )
            task = asyncio.create_task(
                launch,
                name=f"launch {name}/{replica.id}",
            )
            task.add_done_callback(lambda _t: self.wake())
            self._launches[(name, replica.id)] = _Launch(task, backend)
        for replica_id in plan.terminate:
            replica = plan.table[replica_id]
            termination = asyncio.create_task(
                self._backend(replica).terminate(replica.handle),
                name=f"terminate {name}/{replica_id}",
            )
            termination.add_done_callback(lambda _t: self.wake())
            self._terminations[(name, replica_id)] = termination
        for replica in launched:
            plan.event(EventKind.LAUNCH, replica=replica.id, version=replica.version,
                       backend=replica.backend)
        for kind, fields in plan.events:
            await self._store.append_event(name, kind, fields)

    def _terminate_orphan(self, name: str, backend: ReplicaBackend, launched: Launched) -> None:
        log.info("service %s: terminating a replica launched for nothing", name)
        task = asyncio.create_task(backend.terminate(launched.handle))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    def _forget_gone(self, names: set[str]) -> None:
        for name in self._known - names:
            self._forget(name)
        self._scaling.keep_only(names)
        for key, launch in list(self._launches.items()):
            if key[0] in names or not launch.task.done():
                continue
            del self._launches[key]
            if not launch.task.cancelled() and launch.task.exception() is None:
                self._terminate_orphan(key[0], launch.backend, launch.task.result())
        for key in [k for k in self._terminations if k[0] not in names]:
            if self._terminations[key].done():
                del self._terminations[key]

    def _forget(self, name: str) -> None:
        self._known.discard(name)
        self._fleet.pop(name, None)
        self._scaling.forget(name)
        self._probe_results.pop(name, None)
        self._prober.forget_service(name)
        for key in [k for k in self._specs if k[0] == name]:
            del self._specs[key]

    # -- helpers -----------------------------------------------------------------------------

    async def _spec(self, record: ServiceRecord, version: int) -> ServiceSpec:
        key = (record.name, record.created_at, version)
        spec = self._specs.get(key)
        if spec is None:
            raw = await self._store.spec(record.name, version)
            if raw is None:
                raise StoreError(f"service {record.name}: no spec stored for version {version}")
            spec = ServiceSpec.from_json(raw)
            self._specs[key] = spec
        return spec

    def _backend(self, replica: ReplicaRecord) -> ReplicaBackend:
        backend = self._backends.get(replica.backend)
        if backend is None:
            hint = ""
            if replica.backend == "skypilot":
                hint = " (start the controller with --backend skypilot)"
            raise StoreError(f"replica {replica.id}: unknown backend {replica.backend!r}{hint}")
        return backend

    def _due(self, at: float) -> None:
        if self._deadline is None or at < self._deadline:
            self._deadline = at

    async def _idle(self) -> None:
        timeout = self.config.reconcile_interval
        if self._deadline is not None:
            timeout = min(timeout, max(0.0, self._deadline - self._clock()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()

    async def _listen(self) -> None:
        """Wake the loop on every nudge; resubscribe (with backoff) when Redis drops."""
        backoff = 0.1
        while True:
            try:
                subscription = await self._store.subscribe_control()
                try:
                    backoff = 0.1
                    self.wake()  # anything published while unsubscribed is lost: look now
                    while True:
                        nudge = await subscription.get(timeout=5.0)
                        if nudge is not None and nudge.reason == "demand":
                            self.demand(nudge.service)
                        elif nudge is not None:
                            self.wake()
                finally:
                    await subscription.aclose()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("control channel: %s; resubscribing in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)


# -- the leader lease --------------------------------------------------------------------------


def default_holder() -> str:
    """A lease holder name unique to this process: host:pid:random."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def unique_holder(name: str | None) -> str:
    """The lease holder id of this process: `name` (default host:pid) plus a random
    token, so that two controllers given the same `--holder` never both lead."""
    if name is None:
        return default_holder()
    return f"{name}:{uuid.uuid4().hex[:8]}"


async def run_controller(
    config: ControllerConfig,
    *,
    started: asyncio.Event | None = None,
    backends: Mapping[str, ReplicaBackend] | None = None,
) -> None:
    """Run a controller until cancelled, leading only while holding the leader lease.

    Stands by (polling the lease every third of its TTL) until it acquires it;
    then starts a Controller, sets `started`, and renews the lease every third
    of its TTL. If renewal fails, a commit finds the lease gone (LeaseLost: the
    store is fenced by this holder), or Redis stays unreachable for most of a
    TTL, it stops the controller (replicas keep running) and stands by again. On
    cancellation it closes the controller and releases the lease, so a standby
    takes over at once. The holder id is `config.holder` plus a random token.
    """
    holder = unique_holder(config.holder)
    store = Store.from_url(
        config.redis_url, prefix=config.prefix, ca_file=config.redis_ca_file, fence=holder
    )
    try:
        while True:
            await _acquire(store, holder, config.lease_ttl)
            log.info("controller %s: leading", holder)
            controller = Controller(store, config, backends=backends)
            stepping_down = False
            try:
                await controller.start()
                if started is not None:
                    started.set()
                await _lead(store, holder, config.lease_ttl, controller)
                stepping_down = True  # _lead returns only when the lease is lost
            finally:
                await controller.aclose(stepping_down=stepping_down)
            log.warning("controller %s: lost the lease; standing by", holder)
    finally:
        with contextlib.suppress(StoreError):
            await store.release_lease(holder)
        await store.aclose()


async def _renew(store: Store, holder: str, ttl: float) -> bool | None:
    """Renew the lease: True if renewed, False if someone else holds it (or it expired),
    None if Redis did not answer within a third of the TTL."""
    try:
        async with asyncio.timeout(ttl / 3):
            return await store.renew_lease(holder, ttl)
    except (StoreError, TimeoutError) as exc:
        log.warning("controller %s: renewing the lease: %s", holder,
                    str(exc) or type(exc).__name__)  # fmt: skip
        return None


async def _acquire(store: Store, holder: str, ttl: float) -> None:
    said = False
    while True:
        try:
            if await store.acquire_lease(holder, ttl):
                return
            if not said:
                log.info("controller %s: standing by (the lease is %s's)", holder,
                         await store.lease_holder())  # fmt: skip
                said = True
        except StoreError as exc:
            log.warning("controller %s: lease: %s", holder, exc)
        await asyncio.sleep(ttl / 3)


async def _lead(store: Store, holder: str, ttl: float, controller: Controller) -> None:
    """Run the controller while renewing the lease; return when the lease is lost.

    A renewal that does not answer within a third of the TTL counts as failed
    (a stalled Redis must not leave a leader acting on an expired lease), and
    the leader steps down before the lease can have expired under it. A commit
    refused by the fence (LeaseLost) ends `run()`: the leader steps down at once,
    even while a renewal is still waiting for an answer. A cancellation of this
    coroutine always propagates.
    """
    runner = asyncio.create_task(controller.run(), name="controller")
    last_renewed = time.monotonic()
    try:
        while True:
            done: set[asyncio.Task[Any]]
            done, _ = await asyncio.wait({runner}, timeout=ttl / 3)
            renewal: asyncio.Task[bool | None] | None = None
            if not done:
                renewal = asyncio.create_task(_renew(store, holder, ttl))
                try:
                    done, _ = await asyncio.wait(
                        {runner, renewal}, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    renewal.cancel()
                    await asyncio.wait({renewal})
            if runner in done or renewal is None:
                with contextlib.suppress(LeaseLost):
                    runner.result()  # run() only ends by raising
                log.warning("controller %s: %s", holder, runner.exception())
                return  # a commit was refused: the lease is someone else's
            renewed = renewal.result()
            if renewed is False:
                return  # someone else holds it, or it expired
            if renewed:
                last_renewed = time.monotonic()
            elif time.monotonic() - last_renewed > ttl * 0.6:
                return  # step down before the lease can expire under us
    finally:
        runner.cancel()
        # asyncio.wait (not `await runner` under suppress): a cancellation of *this*
        # task must propagate, or SIGTERM would turn into "lost the lease" and the
        # controller would lead again.
        await asyncio.wait({runner})
        failure = None if runner.cancelled() else runner.exception()
        if failure is not None and not isinstance(failure, LeaseLost):
            log.error("controller %s: run() failed", holder, exc_info=runner.exception())
