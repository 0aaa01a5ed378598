"""The external backend: replicas someone else runs, registered by URL.

`sluice replica add NAME URL` (or `ops.add_replica`, or any Redis client)
writes the replica's record; the controller probes it and routes to it once
READY, and drops it after `sluice replica remove` and the drain delay. It is
never launched, restarted or killed from here.
"""

from __future__ import annotations

from controlplane.backends.base import Launched, LaunchFailed
from controlplane.records import Handle
from controlplane.servicespec import ServiceSpec


class ExternalBackend:
    """Replicas registered from outside: nothing to launch, nothing to kill."""

    name = "external"
    can_launch = False

    async def start(self) -> None:
        """Nothing to acquire."""

    async def aclose(self) -> None:
        """Nothing to release."""

    async def launch(
        self, service: str, replica_id: int, version: int, spec: ServiceSpec
    ) -> Launched:
        """Always fails: external replicas are registered with `sluice replica add`."""
        raise LaunchFailed("external replicas are registered with `sluice replica add`")

    def recover(self, service: str, replica_id: int) -> Launched | None:
        """Nothing to recover: the record is all there is."""
        return None

    def exited(self, handle: Handle) -> str | None:
        """Unknown from here: the prober alone judges an external replica."""
        return None

    async def terminate(self, handle: Handle) -> None:
        """No-op: the replica belongs to whoever registered it."""
