"""Every replica transition, in one place: pure functions of a record, what happened
and the time. The controller (`controlplane.reconcile`) and the ops commands
(`controlplane.ops`) apply what they return; the status sets they reason with are
`controlplane.states`'.

Probe results and exits (Sky Serve's semantics):
- 200: READY (first_ready_at set on the first one), failure count reset.
- failure, never READY before: stays STARTING until `initial_delay_seconds`
  after its first failed probe (`first_not_ready_at`; Sky Serve's
  `first_not_ready_time`), then FAILED_INITIAL_DELAY.
- failure after having been READY: NOT_READY (out of the ready set) at once;
  FAILED_PROBING once failures have lasted longer than
  `consecutive_failure_threshold_timeout`.
- the replica's process exited: FAILED.
External replicas never fail for good: they wait until they answer again.

Launches and terminations (the controller):
- PENDING/PROVISIONING -> STARTING when the backend's launch finished (`started`);
  FAILED when the task's own setup failed, FAILED_PROVISION for any other launch
  failure (`launch_failed`);
- a spot replica the backend reports preempted -> PREEMPTED (`preempted`);
- a retired live replica -> SHUTTING_DOWN (`retired`), terminated after the drain;
- a termination that failed -> FAILED_CLEANUP (`cleanup_failed`).

Ops commands (`taken_down`, `preempted_by_ops`, `external_replica`) leave
`status_since` (and `launched_at`) unset: the controller stamps them with its own
clock (`stamped`).

Imports records, states, the spec's probe settings and the prober's result type only.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from controlplane.prober import ProbeResult
from controlplane.records import Handle, ReplicaRecord
from controlplane.servicespec import ReadinessProbe
from controlplane.states import PROBED, EventKind, ReplicaStatus

_replace = msgspec.structs.replace


@dataclass(frozen=True, slots=True)
class Transition:
    """What a transition did: the new record, and an event to log (with its reason)."""

    record: ReplicaRecord
    event: EventKind | None = None  # READY, NOT_READY, FAILURE or PREEMPT
    reason: str | None = None


# -- probes and exits ---------------------------------------------------------------------------


def apply_probe(
    replica: ReplicaRecord,
    result: ProbeResult,
    probe: ReadinessProbe,
    now: float,
    *,
    can_fail: bool = True,
) -> Transition:
    """The replica after a probe result (see the module docstring).

    `can_fail=False` (external replicas, which nobody here can replace) never moves
    to a FAILED_* state: such a replica waits, STARTING or NOT_READY, until it
    answers again or is removed.
    """
    if replica.status not in PROBED or result.url != replica.url:
        return Transition(replica)
    if result.ok:
        return _probe_ok(replica, now)
    if replica.first_ready_at is None:
        return _probe_failed_never_ready(replica, result, probe, now, can_fail=can_fail)
    if replica.status is ReplicaStatus.READY:
        return Transition(
            _replace(replica, status=ReplicaStatus.NOT_READY, status_since=now, failures=1),
            EventKind.NOT_READY,
            f"probe failed: {result.detail}",
        )
    # NOT_READY (or STARTING after a restart of a once-ready replica): count the failure.
    since = replica.status_since if replica.status_since is not None else now
    if can_fail and now - since > probe.consecutive_failure_threshold_timeout:
        reason = (
            f"probes failing for {now - since:.0f}s > consecutive_failure_threshold_timeout="
            f"{probe.consecutive_failure_threshold_timeout:g} (last: {result.detail})"
        )
        return _failed(replica, ReplicaStatus.FAILED_PROBING, now, reason)
    return Transition(_replace(replica, failures=replica.failures + 1))


def _probe_ok(replica: ReplicaRecord, now: float) -> Transition:
    if replica.status is ReplicaStatus.READY:
        if replica.failures:
            return Transition(_replace(replica, failures=0))
        return Transition(replica)
    ready = _replace(
        replica,
        status=ReplicaStatus.READY,
        status_since=now,
        first_ready_at=replica.first_ready_at or now,
        failures=0,
    )
    return Transition(ready, EventKind.READY)


def _probe_failed_never_ready(
    replica: ReplicaRecord, result: ProbeResult, probe: ReadinessProbe, now: float,
    *, can_fail: bool,
) -> Transition:  # fmt: skip
    # Sky Serve (replica_managers.py, `_probe_all_replicas`) times the initial delay
    # from the first failed probe, not from the launch.
    if replica.first_not_ready_at is None:
        return Transition(_replace(replica, first_not_ready_at=now))
    if can_fail and now - replica.first_not_ready_at > probe.initial_delay_seconds:
        reason = (
            f"not ready within initial_delay_seconds={probe.initial_delay_seconds:g} "
            f"(last probe: {result.detail})"
        )
        return _failed(replica, ReplicaStatus.FAILED_INITIAL_DELAY, now, reason)
    return Transition(replica)


def _failed(replica: ReplicaRecord, status: ReplicaStatus, now: float, reason: str) -> Transition:
    failed = _replace(replica, status=status, status_since=now, failures=replica.failures + 1)
    return Transition(failed, EventKind.FAILURE, reason)


def apply_exit(replica: ReplicaRecord, reason: str, now: float) -> Transition:
    """The replica after its process ended: FAILED (the reason says how)."""
    when = "before it was ever ready" if replica.first_ready_at is None else "after being ready"
    failed = _replace(replica, status=ReplicaStatus.FAILED, status_since=now)
    return Transition(failed, EventKind.FAILURE, f"process {reason} {when}")


# -- launches, preemptions, retirement, termination (the controller) ---------------------------


def started(replica: ReplicaRecord, url: str, handle: Handle, now: float) -> ReplicaRecord:
    """The replica once its launch finished: STARTING at `url`; one retired (or failed)
    while launching only records the handle, so that it gets terminated."""
    if replica.status in (ReplicaStatus.PENDING, ReplicaStatus.PROVISIONING):
        return _replace(
            replica,
            status=ReplicaStatus.STARTING,
            url=url,
            handle=handle,
            launched_at=now,
            status_since=now,
        )
    return _replace(replica, url=url, handle=handle)


def launch_failed(
    replica: ReplicaRecord, error: BaseException, now: float, *, task_failed: bool
) -> Transition:
    """The replica whose launch raised `error`. `task_failed`: the task's own setup
    failed, which is the user's code failing as a process exit is (FAILED); anything
    else is a provisioning failure (FAILED_PROVISION), retried."""
    if task_failed:
        status, reason = ReplicaStatus.FAILED, str(error)
    else:
        status, reason = ReplicaStatus.FAILED_PROVISION, f"launch failed: {error}"
    return Transition(
        _replace(replica, status=status, status_since=now), EventKind.FAILURE, reason
    )


def preempted(replica: ReplicaRecord, why: str, now: float) -> Transition:
    """A spot replica the backend reports preempted: replaced, never counted as a failure
    (Sky Serve's rule)."""
    record = _replace(replica, status=ReplicaStatus.PREEMPTED, status_since=now)
    return Transition(record, EventKind.PREEMPT, why)


def retired(replica: ReplicaRecord, now: float) -> ReplicaRecord:
    """A replica leaving service: out of the ready set, drained, then terminated."""
    return _replace(replica, status=ReplicaStatus.SHUTTING_DOWN, status_since=now)


def cleanup_failed(replica: ReplicaRecord, error: BaseException, now: float) -> Transition:
    """The replica whose termination raised `error`: FAILED_CLEANUP."""
    record = _replace(replica, status=ReplicaStatus.FAILED_CLEANUP, status_since=now)
    return Transition(record, EventKind.FAILURE, f"terminate failed: {error}")


def stamped(replica: ReplicaRecord, now: float) -> ReplicaRecord:
    """Time what ops commands wrote with the controller's clock (theirs may be skewed)."""
    if replica.status_since is None:
        replica = _replace(replica, status_since=now)
    if replica.status is ReplicaStatus.STARTING and replica.launched_at is None:
        replica = _replace(replica, launched_at=now)
    return replica


def relabelled(replica: ReplicaRecord, version: int, target_qps: float | None) -> ReplicaRecord:
    """A reused replica (count-only update, or external) labelled with the latest version."""
    return _replace(replica, version=version, target_qps=target_qps)


# -- ops commands (no timestamps: the controller stamps them) ----------------------------------


def taken_down(replica: ReplicaRecord) -> ReplicaRecord:
    """`sluice down --replica-id` / `replica remove`: SHUTTING_DOWN, drained by the
    controller."""
    return _replace(replica, status=ReplicaStatus.SHUTTING_DOWN, status_since=None)


def preempted_by_ops(replica: ReplicaRecord) -> ReplicaRecord:
    """`sluice replica preempt` (spot testing): PREEMPTED."""
    return _replace(replica, status=ReplicaStatus.PREEMPTED, status_since=None)


def external_replica(
    replica_id: int,
    version: int,
    url: str,
    *,
    spot: bool,
    accelerator: str | None,
    target_qps: float | None,
) -> ReplicaRecord:
    """A replica registered by `sluice replica add`: STARTING, probed by the controller."""
    return ReplicaRecord(
        id=replica_id,
        status=ReplicaStatus.STARTING,
        version=version,
        url=url,
        backend="external",
        spot=spot,
        accelerator=accelerator,
        target_qps=target_qps,
    )
