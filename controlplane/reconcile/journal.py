"""The controller log's account of each committed step: one INFO line per replica state
change (with its reason), service status change, autoscaler decision that changed the
target, and rollout step (launch, relabel, drain, terminate), so `sluice logs NAME
--controller` tells what happened without Redis.

Pure formatting of a `ServicePlan` after its commit; `Journal` remembers only the last
autoscaler target per service (to log a decision once, not at every step).
"""

from __future__ import annotations

import logging

from controlplane.reconcile.serviceplan import ServicePlan
from controlplane.states import EventKind

log = logging.getLogger("sluice.controller")

# Events whose line the state change already carries (reason included).
_STATE_EVENTS = (EventKind.READY, EventKind.NOT_READY, EventKind.FAILURE, EventKind.PREEMPT)


class Journal:
    def __init__(self) -> None:
        self._targets: dict[str, int] = {}

    def forget(self, name: str) -> None:
        self._targets.pop(name, None)

    def committed(self, plan: ServicePlan) -> None:
        """Log what `plan` changed (call once it is written)."""
        name = plan.name
        reasons: dict[int, str] = {}
        for kind, fields in plan.events:
            replica = fields.get("replica")
            if kind in _STATE_EVENTS and isinstance(replica, int) and "reason" in fields:
                reasons[replica] = str(fields["reason"])
        if plan.status is not None and plan.status is not plan.record.status:
            log.info("service %s: %s -> %s", name, plan.record.status.value, plan.status.value)
        for replica_id in sorted(plan.changed):
            before, after = plan.base.get(replica_id), plan.table.get(replica_id)
            if after is None:
                log.info("service %s: replica %d removed", name, replica_id)
            elif before is None or before.status is not after.status:
                was = "new" if before is None else before.status.value
                line = f"service {name}: replica {replica_id} (v{after.version}) {was} -> " \
                       f"{after.status.value}"  # fmt: skip
                if replica_id in reasons:
                    line += f": {reasons[replica_id]}"
                log.info("%s", line)
        for kind, fields in plan.events:
            if kind in _STATE_EVENTS or kind is EventKind.LAUNCH:
                continue  # the state change above, or the launch line below
            shown = " ".join(f"{k}={v}" for k, v in fields.items())
            log.info("service %s: %s %s", name, kind.value, shown)
        step = plan.scale
        if step is not None and step.status is not None:
            decision = step.status
            if self._targets.get(name) != decision.target:
                self._targets[name] = decision.target
                signal = (
                    f", QPS {decision.qps:.2f}" if decision.qps is not None
                    else f", in flight {decision.inflight:g}" if decision.inflight is not None
                    else ""
                )  # fmt: skip
                log.info("service %s: autoscaler: target %d replicas (%s%s)", name,
                         decision.target, decision.reason, signal)  # fmt: skip

    def launched(self, name: str, replica_id: int, version: int, backend: str) -> None:
        log.info("service %s: launching replica %d (v%d) on the %s backend", name,
                 replica_id, version, backend)  # fmt: skip
