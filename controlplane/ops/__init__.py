"""What the ops commands do: `up`, `update`, `down` (of services or one replica),
`replica add|remove|preempt` (`commands`), and `status` / `wait_for` (`views`).

They talk to Redis only (through `Store`) and nudge the controller, which does the
work. Owns: the commands, their error tree (`errors`), and the status views. May
import: controlplane's records, states, store, spec, rollout, autoscaler,
lifecycle and backends (for fixed-port checks and SkyPilot's display text), and
`proxy.wire`; never the controller (`controlplane.reconcile`).
"""

from controlplane.ops.commands import (
    add_replica,
    down,
    match_services,
    preempt_replica,
    remove_replica,
    terminate_replica,
    up,
    update,
)
from controlplane.ops.errors import (
    OpsError,
    ReplicaBusy,
    ReplicaExists,
    ReplicaNotFound,
    ServiceShuttingDown,
)
from controlplane.ops.views import (
    LagLimits,
    ProxyView,
    ReplicaStatusView,
    ServiceView,
    status,
    wait_for,
)

__all__ = [
    "LagLimits",
    "OpsError",
    "ProxyView",
    "ReplicaBusy",
    "ReplicaExists",
    "ReplicaNotFound",
    "ReplicaStatusView",
    "ServiceShuttingDown",
    "ServiceView",
    "add_replica",
    "down",
    "match_services",
    "preempt_replica",
    "remove_replica",
    "status",
    "terminate_replica",
    "up",
    "update",
    "wait_for",
]
