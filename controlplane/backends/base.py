"""The one interface every way of running replicas implements: `ReplicaBackend`.

A backend launches a replica of one version of a service and returns where it
serves plus a `Handle` (plain JSON data: pid, port, log path, cluster name ...)
that the controller stores in the replica's record. Everything else the
controller asks goes through that handle, so a controller that takes over
from a dead one carries on with the replicas it finds in Redis (adoption).

Backends never touch Redis and never decide anything: the controller does.

    BackendError
    └── LaunchFailed    the replica could not be started (FAILED_PROVISION; retried)
        └── TaskFailed  the task itself failed: its setup exited non-zero, its workdir
                        is missing (FAILED: Sky's FAILED_SETUP, a user-code failure)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from controlplane.records import Handle
from controlplane.servicespec import ServiceSpec
from proxy.wire.errors import SluiceError


class BackendError(SluiceError):
    """A backend operation failed."""


class LaunchFailed(BackendError):
    """A replica could not be launched; the message is the reason shown by `status`."""


class TaskFailed(LaunchFailed):
    """The user's task failed before it could run (setup exited non-zero ...): like a
    replica process that exited, it gives up a version that never served."""


@dataclass(frozen=True, slots=True)
class Launched:
    """A replica the backend started: where it serves, and how to find it again."""

    url: str
    handle: Handle


class ReplicaBackend(Protocol):
    """Runs replicas. `name` is what replica records store in their `backend` field."""

    name: str

    async def start(self) -> None:
        """Acquire resources (called once, before any other method)."""

    async def aclose(self) -> None:
        """Release resources. Never stops replicas: a successor controller adopts them."""

    @property
    def can_launch(self) -> bool:
        """False for backends whose replicas are registered from outside."""

    async def launch(
        self, service: str, replica_id: int, version: int, spec: ServiceSpec
    ) -> Launched:
        """Start one replica of `spec` (version `version`); raise LaunchFailed."""

    def recover(self, service: str, replica_id: int) -> Launched | None:
        """A replica launched by a controller that died before recording it, if any."""

    def exited(self, handle: Handle) -> str | None:
        """Why the replica's process is gone ("exited with code 1"), or None while it runs.

        Cheap and non-blocking: the controller calls it for every replica on every step.
        """

    async def terminate(self, handle: Handle) -> None:
        """Stop the replica (gracefully first) and release what it held. Idempotent."""


@runtime_checkable
class ClusterBackend(ReplicaBackend, Protocol):
    """A backend whose replicas are remote machines (SkyPilot): what the controller
    additionally tells it and asks it. Every method but `launch` is cheap and non-blocking."""

    async def launch(
        self, service: str, replica_id: int, version: int, spec: ServiceSpec, *, spot: bool = False
    ) -> Launched:
        """As ReplicaBackend.launch; `spot=False` for a spot spec asks for an on-demand
        replica (Sky Serve's on-demand fallback)."""

    def watch(self, wake: Callable[[], None]) -> None:
        """Call `wake` when what `exited` / `preemption` say may have changed."""

    def preemption(self, handle: Handle) -> str | None:
        """Why this spot replica counts as preempted (Sky Serve's rule), or None."""

    def suspect(self, handle: Handle) -> None:
        """A probe of the replica failed: look at its machine again soon."""

    def sweep(self, recorded: Mapping[str, Collection[int]]) -> None:
        """Tear down machines of this backend that no replica record owns.

        `recorded`: every service -> the ids of all its replica records."""
