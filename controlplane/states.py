"""The states of replicas and services, the sets of them the control plane reasons
about, and the kinds of events it records (the `{p}:svc:{name}:events` stream).

Every status set is defined here once; every transition between states is in
controlplane/lifecycle.py.
Imports nothing from sluice.
"""

from __future__ import annotations

import enum


class ReplicaStatus(enum.StrEnum):
    """Replica states, as in Sky Serve."""

    PENDING = "PENDING"
    PROVISIONING = "PROVISIONING"
    STARTING = "STARTING"
    READY = "READY"
    NOT_READY = "NOT_READY"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    FAILED = "FAILED"
    FAILED_INITIAL_DELAY = "FAILED_INITIAL_DELAY"
    FAILED_PROBING = "FAILED_PROBING"
    FAILED_PROVISION = "FAILED_PROVISION"
    FAILED_CLEANUP = "FAILED_CLEANUP"
    PREEMPTED = "PREEMPTED"


#: States from which a replica never comes back on its own (Sky Serve's failed set).
FAILED_REPLICA_STATUSES = frozenset(
    {
        ReplicaStatus.FAILED,
        ReplicaStatus.FAILED_INITIAL_DELAY,
        ReplicaStatus.FAILED_PROBING,
        ReplicaStatus.FAILED_PROVISION,
        ReplicaStatus.FAILED_CLEANUP,
    }
)


class ServiceStatus(enum.StrEnum):
    """Service states, as in Sky Serve."""

    CONTROLLER_INIT = "CONTROLLER_INIT"
    REPLICA_INIT = "REPLICA_INIT"
    CONTROLLER_FAILED = "CONTROLLER_FAILED"
    READY = "READY"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    FAILED = "FAILED"
    FAILED_CLEANUP = "FAILED_CLEANUP"
    NO_REPLICA = "NO_REPLICA"


class UpdateMode(enum.StrEnum):
    """How a new version takes over: alongside the old one, or all at once when ready."""

    ROLLING = "rolling"
    BLUE_GREEN = "blue_green"


#: Replicas that count towards the target: launched or launching, not leaving.
LIVE = frozenset(
    {
        ReplicaStatus.PENDING,
        ReplicaStatus.PROVISIONING,
        ReplicaStatus.STARTING,
        ReplicaStatus.READY,
        ReplicaStatus.NOT_READY,
    }
)

#: Live replicas that have not served yet (the service is still starting while any is).
STARTING_UP = LIVE - {ReplicaStatus.READY}

#: Statuses whose replicas are probed.
PROBED = frozenset({ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.NOT_READY})

#: Failures that give up a version that never served, when they hit a replica that was
#: never READY: the user's code failed (Sky's `user_app_failed`) or the initial delay ran
#: out (`first_ready_time == -1`). Not FAILED_PROVISION: Sky retries failed launches.
UNRECOVERABLE = frozenset({ReplicaStatus.FAILED, ReplicaStatus.FAILED_INITIAL_DELAY})

#: Replicas gone or going: an ops command treats them as absent.
GONE = FAILED_REPLICA_STATUSES | {ReplicaStatus.SHUTTING_DOWN, ReplicaStatus.PREEMPTED}


class EventKind(enum.StrEnum):
    """The `kind` of an audit event (`sluice logs --events`, `Store.events`)."""

    UP = "up"
    UPDATE = "update"
    DOWN = "down"
    LAUNCH = "launch"
    READY = "ready"
    NOT_READY = "not_ready"
    DRAIN = "drain"
    TERMINATE = "terminate"
    PREEMPT = "preempt"
    FAILURE = "failure"
