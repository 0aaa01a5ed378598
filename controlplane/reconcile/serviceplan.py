"""One service's step, planned: `PlanInputs` (what it is planned from, read before
planning) and `ServicePlan` (what to write, then what to do once it is written).
`ServicePlan.mutate` is the commit (`Store.commit_with`): all-or-nothing, `Stale`
when the service record or a replica the plan touches changed since the read.
The steps that fill a plan are `controlplane.reconcile.planner`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from controlplane.backends.base import Launched, ReplicaBackend
from controlplane.lifecycle import Transition
from controlplane.reconcile.drain import DrainReports
from controlplane.reconcile.scalestate import ScaleSignals, ScaleStep
from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.servicespec import ServiceSpec
from controlplane.states import EventKind, ServiceStatus
from controlplane.store import Mutation

EventFields = dict[str, str | int | float]


class Stale(Exception):
    """The state changed under the plan: plan again from a fresh read."""


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What one step of one service is planned from, read before planning."""

    name: str
    record: ServiceRecord
    replicas: dict[int, ReplicaRecord]
    specs: dict[int, ServiceSpec]  # every version in the table, and the latest
    signals: ScaleSignals  # empty unless the autoscaler wants them this step
    now: float
    drain: DrainReports | None = None  # the proxies' reports, read while a replica drains


@dataclass
class ServicePlan:
    """One service's step: what to write, then what to do once it is written."""

    name: str
    record: ServiceRecord  # as read
    base: dict[int, ReplicaRecord]  # the table as read
    table: dict[int, ReplicaRecord]  # the table with the plan applied so far
    now: float
    changed: set[int] = field(default_factory=set)  # ids updated or deleted
    launches: list[ReplicaRecord] = field(default_factory=list)  # ids assigned at commit
    events: list[tuple[EventKind, EventFields]] = field(default_factory=list)
    terminate: list[int] = field(default_factory=list)
    status: ServiceStatus | None = None
    ready_version: int = 0  # the record's, raised when the latest version is READY
    unregister: bool = False
    # Finished tasks whose outcome this plan records; forgotten once it is committed.
    done_launches: list[int] = field(default_factory=list)
    done_terminations: list[int] = field(default_factory=list)
    orphans: list[tuple[ReplicaBackend, Launched]] = field(default_factory=list)
    wake_at: float | None = None  # the earliest time something falls due (drain, probe)
    scale: ScaleStep | None = None  # the autoscaler's step (None while shutting down)

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
            fields: EventFields = {
                "replica": t.record.id,
                "version": t.record.version,
                "status": t.record.status.value,
            }
            if t.reason:
                fields["reason"] = f"replica {t.record.id} (v{t.record.version}): {t.reason}"
            self.events.append((t.event, fields))

    def due(self, at: float) -> None:
        if self.wake_at is None or at < self.wake_at:
            self.wake_at = at

    @property
    def dirty(self) -> bool:
        return (
            bool(self.changed or self.launches)
            or (self.status is not None and self.status is not self.record.status)
            or self.ready_version != self.record.ready_version
        )

    def mutate(
        self, current: ServiceRecord, replicas: dict[int, ReplicaRecord]
    ) -> tuple[Mutation, list[ReplicaRecord]]:
        """The commit (`Store.commit_with`): the plan's writes, and the launched records
        with their ids. Raises Stale if the service record or a replica the plan
        touches changed since the read."""
        if current != self.record:
            raise Stale
        for replica_id in self.changed:
            if replicas.get(replica_id) != self.base.get(replica_id):
                raise Stale
        updates = [self.table[i] for i in sorted(self.changed) if i in self.table]
        deletes = [i for i in sorted(self.changed) if i not in self.table]
        next_id = max(current.next_replica_id, max(replicas, default=0) + 1)
        launched = [
            msgspec.structs.replace(template, id=next_id + i)
            for i, template in enumerate(self.launches)
        ]
        next_id += len(launched)
        record = msgspec.structs.replace(
            current,
            status=self.status if self.status is not None else current.status,
            next_replica_id=next_id,
            ready_version=max(current.ready_version, self.ready_version),
        )
        mutation = Mutation(
            replica_updates=(*updates, *launched),
            replica_deletes=tuple(deletes),
            service_record=record,
        )
        return mutation, launched
