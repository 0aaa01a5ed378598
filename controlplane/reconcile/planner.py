"""The numbered steps of one service's plan: `Planner` turns `PlanInputs` into a
`ServicePlan`, and `Planner.plan` runs the steps below in order, each under its
`# N.` section comment. `controlplane.reconcile.loop` reads the state before and
commits the plan after, in ONE `Store.commit_with` (nothing written when nothing
changed).

1. finished launches: PROVISIONING -> STARTING with the backend's URL and handle
   (or FAILED when its setup failed, FAILED_PROVISION for any other launch
   failure); finished terminations: the record is deleted (or FAILED_CLEANUP);
   launches a dead controller began are adopted or forgotten;
2. liveness: a replica whose process is gone -> FAILED; a spot replica its
   backend reports preempted -> PREEMPTED;
3. probe results (`controlplane.prober`, `controlplane.lifecycle`): READY /
   NOT_READY / FAILED_*;
4. relabel: live replicas of an older version whose spec differs from the
   latest only in relabel-safe fields (`spec.is_count_only_change`), and
   every external replica, become the latest version. In the same commit the
   active versions are recomputed, so the ready set never passes through a
   state where nobody serves;
5. scale and roll out: the service's autoscaler (`reconcile.scalestate`) is
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
   set) until no live proxy reports a request in flight on it, at most
   `drain_seconds` or the spec's `service.sluice.max_drain_seconds` (no drain if
   it never was READY; the rule is `controlplane.reconcile.drain`'s), then
   terminated at once and its record deleted; failed and PREEMPTED replicas are terminated at once
   (and replaced by step 5, since they no longer count). A service
   marked SHUTTING_DOWN by `ops.down` is unregistered when no replica is left;
7. the service status (READY, REPLICA_INIT, NO_REPLICA, FAILED).

Planning does no Redis I/O and never awaits: it is a function of the state read,
the specs and autoscaling signals gathered before it (`loop.Controller._gather`),
the time, the config, and what the controller holds in memory (finished task
outcomes, probe results, the autoscalers' windows, which
`AutoscalerRegistry.observe` advances). The backends and the prober are asked
synchronous questions only (has this process exited, was this spot replica
preempted, what did a dead controller's launch leave; `Prober.poll`, which also
starts the probes that are due). Launches, terminations, events and the
autoscaler's writes happen after the commit (`controlplane.reconcile.loop`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import msgspec

from controlplane import lifecycle
from controlplane.autoscaler import fallback_plan
from controlplane.backends.base import ClusterBackend, LaunchFailed, ReplicaBackend, TaskFailed
from controlplane.prober import ProbeResult
from controlplane.reconcile.config import ControllerConfig, ReadinessProber
from controlplane.reconcile.drain import POLL_SECONDS, SETTLE_SECONDS, DrainReports, DrainWatch
from controlplane.reconcile.scalestate import AutoscalerRegistry, ScaleStep
from controlplane.reconcile.serviceplan import PlanInputs, ServicePlan
from controlplane.reconcile.tasks import TaskRegistry
from controlplane.records import ReplicaRecord
from controlplane.rollout import (
    accelerator_of,
    given_up_by,
    gives_up_version,
    plan_rollout,
    ready_version,
    service_status,
    target_replicas,
)
from controlplane.servicespec import ServiceSpec, is_count_only_change
from controlplane.states import (
    FAILED_REPLICA_STATUSES,
    LIVE,
    PROBED,
    EventKind,
    ReplicaStatus,
    ServiceStatus,
)
from controlplane.store import StoreError

log = logging.getLogger("sluice.controller")


class Planner:
    """The numbered steps of one service's plan (this module's docstring)."""

    def __init__(
        self,
        config: ControllerConfig,
        backends: Mapping[str, ReplicaBackend],
        prober: ReadinessProber,
        tasks: TaskRegistry,
        autoscalers: AutoscalerRegistry,
    ) -> None:
        self._config = config
        self._backends = backends
        self._prober = prober
        self._tasks = tasks
        self._autoscalers = autoscalers
        # Probe results not yet committed (kept across a replan).
        self._probe_results: dict[str, dict[int, ProbeResult]] = {}
        self._drain = DrainWatch()

    def plan(self, inputs: PlanInputs) -> ServicePlan:
        record, now = inputs.record, inputs.now
        plan = ServicePlan(
            name=inputs.name,
            record=record,
            base=dict(inputs.replicas),
            table=dict(inputs.replicas),
            now=now,
            ready_version=record.ready_version,
        )
        latest = inputs.specs[record.version]
        self._finished_tasks(plan)
        self._stamp(plan)
        self._liveness(plan)
        self._probe(plan, inputs.specs)
        self._relabel(plan, inputs.specs, latest)
        plan.ready_version = ready_version(record, plan.table.values())
        if record.status is ServiceStatus.SHUTTING_DOWN:
            for replica in list(plan.table.values()):
                if replica.status in LIVE:
                    self._retire(plan, replica, "down")
        else:
            managed = [r for r in plan.table.values() if self.backend(r).can_launch]
            plan.scale = self._autoscalers.observe(record, latest, managed, inputs.signals, now)
            plan.due(plan.scale.due)
            self._scale(plan, latest, plan.scale)
        self._cleanup(plan, self._max_drain(latest), inputs.drain)
        self._service_status(plan)
        return plan

    def committed(self, name: str) -> None:
        """The plan of `name` was committed: its probe results are recorded."""
        self._probe_results.pop(name, None)

    def forget(self, name: str) -> None:
        """Service `name` is gone: forget what its drains remembered."""
        self._drain.forget(name)

    def _max_drain(self, latest: ServiceSpec) -> float:
        sluice = latest.service.sluice
        if sluice is not None and sluice.max_drain_seconds is not None:
            return sluice.max_drain_seconds
        return self._config.drain_seconds

    def backend(self, replica: ReplicaRecord) -> ReplicaBackend:
        backend = self._backends.get(replica.backend)
        if backend is None:
            hint = ""
            if replica.backend == "skypilot":
                hint = " (start the controller with --backend skypilot)"
            raise StoreError(f"replica {replica.id}: unknown backend {replica.backend!r}{hint}")
        return backend

    # 1. tasks that finished since the last step

    def _finished_tasks(self, plan: ServicePlan) -> None:
        name, now = plan.name, plan.now
        for outcome in self._tasks.finished_launches(name):
            replica_id = outcome.replica_id
            plan.done_launches.append(replica_id)
            replica = plan.table.get(replica_id)
            if outcome.error is not None:
                if not isinstance(outcome.error, LaunchFailed):
                    what = f"service {name}: launch of replica {replica_id} failed"
                    log.error(what, exc_info=outcome.error)
                if replica is not None:
                    # The task's own failure (setup) is the user's code failing, as a
                    # process exit is; anything else is a provisioning failure, retried.
                    failed = isinstance(outcome.error, TaskFailed)
                    plan.transition(
                        lifecycle.launch_failed(replica, outcome.error, now, task_failed=failed)
                    )
            elif outcome.launched is None:  # cancelled
                continue
            elif replica is None:  # deleted meanwhile: nothing will ever route to it
                plan.orphans.append((outcome.backend, outcome.launched))
            else:
                plan.put(lifecycle.started(replica, outcome.launched.url,
                                           outcome.launched.handle, now))  # fmt: skip
        self._finished_terminations(plan)
        self._recover(plan)

    def _finished_terminations(self, plan: ServicePlan) -> None:
        for outcome in self._tasks.finished_terminations(plan.name):
            plan.done_terminations.append(outcome.replica_id)
            replica = plan.table.get(outcome.replica_id)
            if replica is None or outcome.cancelled:
                continue
            if outcome.error is not None:
                plan.transition(lifecycle.cleanup_failed(replica, outcome.error, plan.now))
                continue
            plan.event(EventKind.TERMINATE, replica=replica.id, version=replica.version)
            if gives_up_version(replica, plan.record.version, plan.ready_version):
                plan.put(msgspec.structs.replace(replica, handle={}))  # kept: says why
            else:
                plan.delete(replica.id)

    def _recover(self, plan: ServicePlan) -> None:
        """Launches a dead controller began: adopt what it left, forget the rest."""
        name = plan.name
        for replica in list(plan.table.values()):
            if replica.status not in (ReplicaStatus.PENDING, ReplicaStatus.PROVISIONING):
                continue
            if self._tasks.has_launch(name, replica.id):
                continue
            recovered = self.backend(replica).recover(name, replica.id)
            if recovered is not None:
                plan.put(lifecycle.started(replica, recovered.url, recovered.handle, plan.now))
            else:
                plan.delete(replica.id)
                plan.event(
                    EventKind.TERMINATE,
                    replica=replica.id,
                    version=replica.version,
                    reason="launch interrupted",
                )

    def _stamp(self, plan: ServicePlan) -> None:
        """Time what ops commands wrote with the controller's clock (theirs may be skewed)."""
        for replica in list(plan.table.values()):
            plan.put(lifecycle.stamped(replica, plan.now))

    # 2. liveness

    def _liveness(self, plan: ServicePlan) -> None:
        for replica in list(plan.table.values()):
            if replica.status not in PROBED or not replica.handle:
                continue
            backend = self.backend(replica)
            if replica.spot and isinstance(backend, ClusterBackend):
                why = backend.preemption(replica.handle)
                if why is not None:  # Sky Serve's rule: replaced, never counted as a failure
                    plan.transition(lifecycle.preempted(replica, why, plan.now))
                    continue
            reason = backend.exited(replica.handle)
            if reason is not None:
                plan.transition(lifecycle.apply_exit(replica, reason, plan.now))

    # 3. probes

    def _probe(self, plan: ServicePlan, specs: dict[int, ServiceSpec]) -> None:
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
                backend = self.backend(replica)
                if not result.ok and replica.handle and isinstance(backend, ClusterBackend):
                    backend.suspect(replica.handle)
                can_fail = backend.can_launch
                plan.transition(
                    lifecycle.apply_probe(replica, result, probe, plan.now, can_fail=can_fail)
                )
            due = self._prober.next_due(
                plan.name, replica.id, probe.endpoint_probe_interval_seconds
            )
            if due is not None:
                plan.due(due)

    # 4. relabel

    def _relabel(
        self, plan: ServicePlan, specs: dict[int, ServiceSpec], latest: ServiceSpec
    ) -> None:
        version = plan.record.version
        relabelled = []
        for replica in list(plan.table.values()):
            if replica.version >= version or replica.status not in LIVE:
                continue
            external = not self.backend(replica).can_launch
            if external or is_count_only_change(specs[replica.version], latest):
                target_qps = latest.service.scaling.target_qps_for(replica.accelerator)
                plan.put(lifecycle.relabelled(replica, version, target_qps))
                relabelled.append(str(replica.id))
        if relabelled:
            plan.event(EventKind.UPDATE, version=version, relabelled=",".join(relabelled))

    # 5. scale and roll out

    def _scale(self, plan: ServicePlan, latest: ServiceSpec, scale: ScaleStep) -> None:
        record = plan.record
        backend = self._backends.get(self._config.backend)
        can_launch = (
            bool(latest.run)
            and backend is not None
            and backend.can_launch
            and given_up_by(plan.table.values(), record.version, plan.ready_version) is None
        )
        managed = [r for r in plan.table.values() if self.backend(r).can_launch]
        target = scale.target
        if target is None:
            target = target_replicas(record, latest, plan.table, plan.now)
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

    def _retire(self, plan: ServicePlan, replica: ReplicaRecord, reason: str) -> None:
        plan.put(lifecycle.retired(replica, plan.now))
        plan.event(EventKind.DRAIN, replica=replica.id, version=replica.version, reason=reason)

    # 6. drain and clean up

    def _cleanup(
        self, plan: ServicePlan, max_drain: float, reports: DrainReports | None
    ) -> None:
        name, now = plan.name, plan.now
        launching = self._tasks.launching(name) - set(plan.done_launches)
        live = self._drain.live(name, reports, now) if reports is not None else set()
        for replica in list(plan.table.values()):
            if replica.id in launching or self._tasks.terminating(name, replica.id):
                continue
            if replica.status is ReplicaStatus.SHUTTING_DOWN:
                if not self._drained(plan, replica, max_drain, reports, live):
                    continue
                self._drain.done(name, replica.id)
                if replica.handle and self.backend(replica).can_launch:
                    plan.terminate.append(replica.id)
                else:
                    plan.delete(replica.id)
                    plan.event(EventKind.TERMINATE, replica=replica.id, version=replica.version)
            elif replica.status in FAILED_REPLICA_STATUSES or (
                replica.status is ReplicaStatus.PREEMPTED
            ):
                if replica.handle and self.backend(replica).can_launch:
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

    def _drained(
        self,
        plan: ServicePlan,
        replica: ReplicaRecord,
        max_drain: float,
        reports: DrainReports | None,
        live: set[str],
    ) -> bool:
        """Whether a SHUTTING_DOWN replica may be stopped now: it never was READY, its
        process is gone, no live proxy holds it (controlplane.reconcile.drain), or it
        drained for `max_drain` (a cut, recorded when requests were still in flight).
        Otherwise the plan falls due again when it should be looked at."""
        now = plan.now
        if replica.first_ready_at is None or not replica.url or max_drain <= 0:
            return True
        if replica.handle and self.backend(replica).exited(replica.handle) is not None:
            return True
        since = replica.status_since or now
        bound = since + max_drain
        settled = since + min(SETTLE_SECONDS, max_drain)
        # Only a retirement already committed is judged: the snapshot read with the
        # reports excludes it (one retired in this plan is not published yet).
        committed = (base := plan.base.get(replica.id)) is not None and (
            base.status is ReplicaStatus.SHUTTING_DOWN)  # fmt: skip
        if now < settled or not committed:
            plan.due(min(settled, bound) if now < settled else now + POLL_SECONDS)
            return False
        verdict = (
            self._drain.verdict(plan.name, replica.id, replica.url, reports, live)
            if reports is not None else None
        )  # fmt: skip
        if verdict is not None and verdict.idle:
            plan.event(EventKind.DRAIN, replica=replica.id, version=replica.version,
                       reason="idle", seconds=round(now - since, 3))  # fmt: skip
            return True
        if now >= bound:
            inflight = verdict.inflight if verdict is not None else -1
            log.warning(
                "service %s: replica %d stopped at the maximum drain (%gs) with %s "
                "request(s) in flight (proxies holding it: %s)", plan.name, replica.id,
                max_drain, inflight if inflight >= 0 else "unknown",
                ", ".join(verdict.holders) if verdict is not None else "no reports",
            )  # fmt: skip
            plan.event(EventKind.DRAIN, replica=replica.id, version=replica.version,
                       reason="max_drain", seconds=round(now - since, 3),
                       cut=inflight)  # fmt: skip
            return True
        plan.due(min(now + POLL_SECONDS, bound))
        return False

    # 7. service status

    def _service_status(self, plan: ServicePlan) -> None:
        record = msgspec.structs.replace(plan.record, ready_version=plan.ready_version)
        plan.status = service_status(record, plan.table.values(), launching=bool(plan.launches))
