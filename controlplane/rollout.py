"""The rollout rules: how many replicas to launch, which to retire, the service status.

Pure functions of the service record, the latest spec and the replica table;
the controller applies what they decide. Sky Serve's semantics:

- target: `replicas: N`, or `replica_policy.min_replicas` (`target_replicas`
  is the seam the autoscaler plugs into);
- launch latest-version replicas up to the target, unless the latest version
  is given up: it has never had a READY replica (`ServiceRecord.ready_version`)
  and one of its replicas failed for good before being READY (its process or
  its setup exited, or the initial delay ran out). A failed launch
  (FAILED_PROVISION) gives nothing up, and neither does any failure once the
  version has served: Sky Serve's `latest_version_ever_ready` rule
  (autoscalers.py, `generate_scaling_decisions`) and
  `ReplicaStatusProperty.unrecoverable_failure` (replica_managers.py);
- old-version replicas leave as the new version takes over. rolling: one per
  READY new replica (the old ones kept = target - new READY ones);
  blue_green: all together, once the new version has its min_replicas READY;
- surplus replicas of the latest version leave in scale-down order: earliest
  state first (PENDING, PROVISIONING, STARTING, NOT_READY, READY), older
  version first, (instance-aware) lowest target QPS first, larger id first;
- with spot replicas, spot and on-demand ones are counted apart: the
  controller passes the (spot, on-demand) split of `autoscaler.fallback_plan`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from controlplane.records import ReplicaRecord, ServiceRecord, compute_active_versions
from controlplane.servicespec import ServiceSpec
from controlplane.states import (
    LIVE,
    STARTING_UP,
    UNRECOVERABLE,
    ReplicaStatus,
    ServiceStatus,
    UpdateMode,
)

_SCALE_DOWN_RANK = {
    ReplicaStatus.PENDING: 0,
    ReplicaStatus.PROVISIONING: 1,
    ReplicaStatus.STARTING: 2,
    ReplicaStatus.NOT_READY: 3,
    ReplicaStatus.READY: 4,
}


def target_replicas(
    record: ServiceRecord,
    spec: ServiceSpec,
    replicas: Mapping[int, ReplicaRecord],
    now: float,
) -> int:
    """How many replicas of the latest version the service should run.

    `replicas: N` or `replica_policy.min_replicas`: the fixed count. The
    controller's planner (`controlplane.reconcile.planner`) uses it for services
    without an autoscaling target.
    """
    return spec.min_replicas


def gives_up_version(replica: ReplicaRecord, version: int, ready_version: int) -> bool:
    """True if `replica` failed for good before ever being READY, in `version`, and
    `version` never had a READY replica (`ready_version`: the latest version that had)."""
    return (
        ready_version < version
        and replica.version == version
        and replica.status in UNRECOVERABLE
        and replica.first_ready_at is None
    )


def given_up_by(
    replicas: Iterable[ReplicaRecord], version: int, ready_version: int
) -> ReplicaRecord | None:
    """The replica whose failure stops launches of `version`, if any."""
    return next((r for r in replicas if gives_up_version(r, version, ready_version)), None)


def ready_version(record: ServiceRecord, replicas: Iterable[ReplicaRecord]) -> int:
    """`record.ready_version`, raised to the latest version if one of its replicas is READY."""
    if record.ready_version < record.version and any(
        r.version == record.version and r.status is ReplicaStatus.READY for r in replicas
    ):
        return record.version
    return record.ready_version


def scale_down_order(
    replicas: Iterable[ReplicaRecord], *, by_capacity: bool = False
) -> list[ReplicaRecord]:
    """Earliest state first, then older version, then (instance-aware, `by_capacity`)
    lower target QPS, then larger id."""

    def key(r: ReplicaRecord) -> tuple[int, int, float, int]:
        capacity = (r.target_qps or 0.0) if by_capacity else 0.0
        return (_SCALE_DOWN_RANK.get(r.status, 0), r.version, capacity, -r.id)

    return sorted(replicas, key=key)


@dataclass(frozen=True, slots=True)
class Rollout:
    """What one step does to the managed replicas of a service."""

    launch: int  # new replicas of the latest version
    retire: tuple[tuple[ReplicaRecord, str], ...]  # (replica, reason: update | scale_down)
    launch_spot: int = 0  # how many of `launch` run on spot instances


def plan_rollout(
    record: ServiceRecord,
    managed: Iterable[ReplicaRecord],
    target: int,
    *,
    can_launch: bool,
    split: tuple[int, int] | None = None,
    by_capacity: bool = False,
) -> Rollout:
    """Launches and retirements for `managed` (the LIVE replicas the controller runs).

    `can_launch`: the latest version has a command to run and is not given up.
    `split`: (spot, on-demand) replicas of the latest version to run
    (`autoscaler.fallback_plan`); None: `target` on-demand ones. Each kind is
    launched up to, and retired down to, its own count. `by_capacity`:
    instance-aware, surplus replicas leave lowest target QPS first.
    """
    version = record.version
    live = [r for r in managed if r.status in LIVE]
    new = [r for r in live if r.version == version]
    old = [r for r in live if r.version < version]
    want_spot, want_od = split if split is not None else (0, target)
    new_spot = [r for r in new if r.spot]
    new_od = [r for r in new if not r.spot]
    launch_spot = max(0, want_spot - len(new_spot)) if can_launch else 0
    launch = launch_spot + (max(0, want_od - len(new_od)) if can_launch else 0)
    ready_new = sum(1 for r in new if r.status is ReplicaStatus.READY)
    match record.update_mode:
        case UpdateMode.BLUE_GREEN:
            switched = ready_new >= max(1, record.min_replicas.get(version, 1))
            keep_old = 0 if switched else len(old)
        case UpdateMode.ROLLING:
            keep_old = max(0, target - ready_new)
    retire = [(r, "update") for r in scale_down_order(old)[: max(0, len(old) - keep_old)]]
    for kind, want in ((new_spot, want_spot), (new_od, want_od)):
        surplus = scale_down_order(kind, by_capacity=by_capacity)[: max(0, len(kind) - want)]
        retire += [(r, "scale_down") for r in surplus]
    return Rollout(launch=launch, retire=tuple(retire), launch_spot=launch_spot)


def service_status(
    record: ServiceRecord, replicas: Iterable[ReplicaRecord], *, launching: bool
) -> ServiceStatus:
    """READY with someone to route to; REPLICA_INIT while replicas start (or are about
    to: `launching`); FAILED when the latest version is given up and nothing serves;
    NO_REPLICA otherwise. A SHUTTING_DOWN service stays so."""
    if record.status is ServiceStatus.SHUTTING_DOWN:
        return record.status
    table = list(replicas)
    if compute_active_versions(record, table):
        return ServiceStatus.READY
    if launching or any(r.status in STARTING_UP for r in table):
        return ServiceStatus.REPLICA_INIT
    if given_up_by(table, record.version, ready_version(record, table)) is not None:
        return ServiceStatus.FAILED
    return ServiceStatus.NO_REPLICA


def accelerator_of(spec: ServiceSpec) -> str | None:
    """The replica accelerator a spec asks for, as "A100:1" (first choice of several)."""
    match spec.resources.accelerators:
        case None:
            return None
        case str() as name:
            return name
        case dict() as table:
            for name, count in table.items():  # {L4:1, A10G:1} reads as {"L4:1": None}
                return name if count is None else f"{name}:{count:g}"
        case list() as names:
            return names[0] if names else None
    return None
