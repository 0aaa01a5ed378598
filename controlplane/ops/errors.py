"""The ops commands' errors (besides the store's ServiceNotFound / ServiceExists /
StoreUnavailable):

    OpsError
    ├── ServiceShuttingDown   the service is being taken down; it takes no changes
    ├── ReplicaExists         `add_replica` of a URL the service already routes to
    ├── ReplicaNotFound       `remove_replica` of a URL it has no external replica for,
    │                         `preempt_replica` / `terminate_replica` of an unknown id
    └── ReplicaBusy           `terminate_replica` of one shutting down, or failed
                              without `purge`
"""

from __future__ import annotations

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
