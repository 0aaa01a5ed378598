"""The SkyPilot backend's view of its clusters: a cache of `sky.status` for one
namespace, refreshed by a background task that this object owns.

The refresher lists the namespace's clusters every `refresh_interval`, and at once
when a replica is suspected (`suspect()`: a failed probe), with a forced cloud
refresh for the suspects (at most every `nonspot_refresh_gap` for on-demand
clusters). `not_up()` answers from the last listing that began after a replica's
launch, so a listing older than the cluster never calls it gone. `adoptable()` and
`orphans()` read the listing for adoption and the sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Collection, Mapping

from controlplane.backends.skypilot_sdk import UP, ClusterInfo, SdkError, SkyPilotSdk
from controlplane.backends.skypilot_task import cluster_prefix, parse_cluster
from controlplane.records import Handle
from proxy.stopping import cancel_requested

log = logging.getLogger("sluice.backend.skypilot")


class ClusterStatus:
    """The namespace's clusters as last listed, their endpoints, and the refresher.

    `launching`: clusters whose launch is in flight (kept as recorded when a listing
    that began before they came up does not show them).
    """

    def __init__(
        self,
        namespace: str,
        *,
        clock: Callable[[], float],
        refresh_interval: float,
        refresh_timeout: float,
        nonspot_refresh_gap: float,
    ) -> None:
        self._namespace = namespace
        self._prefix = cluster_prefix(namespace, "")
        self._clock = clock
        self._refresh_interval = refresh_interval
        self._refresh_timeout = refresh_timeout
        self._nonspot_refresh_gap = nonspot_refresh_gap
        self.clusters: dict[str, ClusterInfo] = {}  # this namespace's clusters, as last listed
        self.endpoints: dict[str, dict[int, str]] = {}
        self.listed_at: float | None = None  # when the listing in `clusters` began
        self.launching: set[str] = set()
        self._suspects: set[str] = set()
        self._suspected_at: dict[str, float] = {}
        self._wake: Callable[[], None] | None = None
        self._kick = asyncio.Event()
        self._refresher: asyncio.Task[None] | None = None

    def watch(self, wake: Callable[[], None]) -> None:
        """Call `wake` whenever a refresh changed the listing."""
        self._wake = wake

    async def start(self, sdk: SkyPilotSdk) -> None:
        """List the clusters once (so adoption sees them), then start the refresher."""
        try:
            await self.refresh(sdk)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("skypilot: listing clusters: %s", exc)
        self._refresher = asyncio.create_task(self._refresh_loop(sdk), name="skypilot status")

    def stop(self) -> asyncio.Task[None] | None:
        """Cancel the refresher; returns it for the caller to await."""
        task, self._refresher = self._refresher, None
        if task is not None:
            task.cancel()
        return task

    # -- what the backend asks ---------------------------------------------------------------

    def record(self, name: str, info: ClusterInfo, endpoints: dict[int, str]) -> None:
        """A launch brought cluster `name` up."""
        self.clusters[name] = info
        self.endpoints[name] = endpoints

    def forget(self, name: str) -> None:
        """Cluster `name` was torn down."""
        self.clusters.pop(name, None)
        self.endpoints.pop(name, None)
        self._suspected_at.pop(name, None)

    def not_up(self, handle: Handle) -> str | None:
        """Why the replica's cluster is gone or not UP per the last listing that began
        after its launch; None while it is UP or not listed since."""
        name = handle.get("cluster")
        if not isinstance(name, str):
            return "no cluster recorded"
        launched = handle.get("launched")
        if self.listed_at is None or (
            isinstance(launched, int | float) and self.listed_at < launched
        ):
            return None
        info = self.clusters.get(name)
        if info is None:
            return f"cluster {name} is gone"
        if info.status != UP:
            return f"cluster {name} is {info.status}"
        return None

    def suspect(self, handle: Handle) -> None:
        """A probe of this replica failed: refresh its cluster's status from the cloud now
        (spot), or at most every `nonspot_refresh_gap` (on-demand)."""
        name = handle.get("cluster")
        if not isinstance(name, str):
            return
        now = self._clock()
        gap = 0.0 if handle.get("spot") else self._nonspot_refresh_gap
        last = self._suspected_at.get(name)
        if last is not None and now - last < gap:
            return
        self._suspected_at[name] = now
        self._suspects.add(name)
        self._kick.set()

    def adoptable(
        self, service: str, replica_id: int
    ) -> tuple[str, ClusterInfo, int, str] | None:
        """(name, cluster, port, endpoint) of an UP cluster of this replica (any version)
        with exactly one exposed port, as last listed; else None."""
        prefix = cluster_prefix(self._namespace, service)
        for name, info in self.clusters.items():
            parsed = parse_cluster(prefix, name)
            if parsed is None or parsed[0] != replica_id or info.status != UP:
                continue
            endpoints = self.endpoints.get(name, {})
            if len(endpoints) != 1:
                return None
            ((port, endpoint),) = endpoints.items()
            return name, info, port, endpoint
        return None

    def orphans(
        self, recorded: Mapping[str, Collection[int]], *, busy: Collection[str]
    ) -> list[tuple[str, str]]:
        """(cluster, why) for each listed cluster of this namespace that no replica record
        in `recorded` (service -> replica ids) owns; clusters launching or in `busy` (being
        torn down) are left alone. Nothing before the first listing."""
        if self.listed_at is None:
            return []
        namespace = re.escape(self._prefix)
        # The namespace's prefix ends with the `.` no slug holds: exactly this namespace.
        ours = re.compile(rf"{namespace}[a-z0-9][-a-z0-9]*-r[0-9]+-v[0-9]+")
        prefixes = {svc: cluster_prefix(self._namespace, svc) for svc in recorded}
        found: list[tuple[str, str]] = []
        for name in list(self.clusters):
            if name in self.launching or name in busy:
                continue
            owner = next(
                ((svc, parsed) for svc, p in prefixes.items()
                 if (parsed := parse_cluster(p, name)) is not None),
                None,
            )  # fmt: skip
            if owner is None:
                if not ours.fullmatch(name):
                    continue
                why = "its service is gone"
            elif owner[1][0] in recorded[owner[0]]:
                continue
            else:
                why = f"service {owner[0]} has no replica {owner[1][0]}"
            found.append((name, why))
        return found

    # -- the refresher -----------------------------------------------------------------------

    async def _refresh_loop(self, sdk: SkyPilotSdk) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._refresh_interval):
                    await self._kick.wait()
            self._kick.clear()
            try:
                async with asyncio.timeout(self._refresh_timeout):
                    await self.refresh(sdk)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("skypilot: refreshing cluster status: %s", exc or "timeout")
            if cancel_requested():  # a library turned our cancel into an error: stop anyway
                raise asyncio.CancelledError

    async def refresh(self, sdk: SkyPilotSdk) -> None:
        """List the namespace's clusters (the suspects forced from the cloud)."""
        began = self._clock()
        suspects, self._suspects = self._suspects, set()
        listed = {c.name: c for c in await sdk.status() if c.name.startswith(self._prefix)}
        fresh: dict[str, ClusterInfo] | None = None
        if suspects:
            try:
                forced = await sdk.status(sorted(suspects), refresh=True)
                fresh = {c.name: c for c in forced}
            except SdkError as exc:  # the listing above still counts
                log.warning("skypilot: refreshing %s: %s", ", ".join(sorted(suspects)), exc)
        if fresh is not None:
            for name in suspects:
                if name in fresh:
                    listed[name] = fresh[name]
                else:
                    listed.pop(name, None)
        for name, info in listed.items():
            if info.status == UP and name not in self.endpoints:
                with contextlib.suppress(SdkError):
                    self.endpoints[name] = await sdk.endpoints(name)
        # Launches that finished meanwhile are not in this listing: keep what they recorded.
        for name in self.launching:
            if name in self.clusters and name not in listed:
                listed[name] = self.clusters[name]
        changed = listed != self.clusters
        self.clusters = listed
        for name in [n for n in self.endpoints if n not in listed]:
            del self.endpoints[name]
        self.listed_at = began
        if changed and self._wake is not None:
            self._wake()
