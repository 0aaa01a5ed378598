"""The SkyPilot backend: each replica is one SkyPilot cluster (clouds, Kubernetes, spot).

Launch: the user's service YAML minus `service:` is the SkyPilot task
(`task_config`); the replica's port is added to `resources.ports`, and the
task's envs get `SLUICE_REPLICA_ID` / `SKYPILOT_SERVE_REPLICA_ID` (and `PORT`
unless the YAML sets it). An on-demand replica of a spot service (Sky Serve's
`base_ondemand_fallback_replicas` / `dynamic_ondemand_fallback`) gets
`use_spot: false` everywhere. The cluster is named `{namespace}-{service}-r{id}-v{version}`
(`cluster_name`; the namespace is the Redis prefix), within SkyPilot's
cluster-name regex. The replica URL is the cluster's endpoint for the port,
path kept (Kubernetes ingress endpoints carry one).

Failures: a launch SkyPilot reports as retryable (no capacity after its own
failover, an API server hiccup) is retried `launch_retries` times with
exponential backoff; the whole launch is bounded by `launch_timeout`. A launch
that fails, times out or is cancelled cancels its request and asks SkyPilot to
tear the cluster down, so a half-made cluster never lingers; the error text is
SkyPilot's, and the controller shows it with FAILED_PROVISION.

Liveness: `exited()` and `preemption()` answer from the status cache
(skypilot_status.py, refreshed in the background; `suspect()` hurries it). A spot
cluster that is gone or not UP is a preemption; `spot_placer: dynamic_fallback`
remembers where and steers the next spot launches to the task's other `any_of` /
`ordered` locations (`task_config`); without such a list SkyPilot's optimizer picks.

Termination: `sky.down`, idempotent (a missing cluster is done), retried with
backoff; it runs in the controller's termination task, never in a step.

Adoption: `recover()` finds the UP cluster of a replica whose launch a dead
controller left unrecorded; `sweep()` (given every recorded replica id per
service) tears down clusters of this namespace that no record owns.

Beside it: skypilot_task.py (names, the task, status texts; pure), skypilot_status.py
(the status cache), skypilot_sdk.py (SkyPilot's SDK behind one adapter).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from controlplane.backends.base import BackendError, Launched, LaunchFailed
from controlplane.backends.skypilot_sdk import (
    INIT,
    UP,
    ClusterGone,
    ClusterInfo,
    SdkError,
    SkyPilotClient,
    SkyPilotSdk,
)
from controlplane.backends.skypilot_status import ClusterStatus
from controlplane.backends.skypilot_task import (
    cluster_name,
    infra_text,
    location_of,
    replica_url,
    task_config,
)
from controlplane.records import Handle
from controlplane.servicespec import ServiceSpec

log = logging.getLogger("sluice.backend.skypilot")


@dataclass(frozen=True, kw_only=True)
class SkyPilotConfig:
    """The backend's knobs (the CLI's defaults; tests shorten them).

    `namespace`: the first part of every cluster name (the Redis prefix), so two
    sluice deployments on one SkyPilot account keep apart. `base_dir`: what a
    relative `workdir` is relative to.
    """

    namespace: str = "sluice"
    base_dir: Path | None = None
    launch_timeout: float = 1800.0
    launch_retries: int = 2
    retry_backoff: float = 30.0
    down_retries: int = 5
    down_backoff: float = 10.0
    down_timeout: float = 900.0
    refresh_interval: float = 20.0
    refresh_timeout: float = 120.0
    nonspot_refresh_gap: float = 60.0
    submit_timeout: float = 60.0  # cancelling a request / submitting a down on the way out



async def stream_logs(sdk: SkyPilotSdk, handle: Handle, *, follow: bool, out: TextIO) -> int:
    """Copy the replica cluster's job log (`sky.tail_logs`) to `out`; the job's exit code."""
    name = handle.get("cluster")
    if not isinstance(name, str):
        raise BackendError("the replica has no cluster recorded (its launch did not finish)")
    return await sdk.tail_logs(name, follow=follow, out=out)


# -- the backend ---------------------------------------------------------------------------------


class SkyPilotBackend:
    """Replicas as SkyPilot clusters; see the module docstring."""

    name = "skypilot"
    can_launch = True

    def __init__(
        self,
        config: SkyPilotConfig | None = None,
        *,
        sdk: Callable[[], SkyPilotSdk] = SkyPilotClient,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`sdk`: makes the SDK adapter in `start()` (tests pass a fake's)."""
        self._config = config or SkyPilotConfig()
        self._make_sdk = sdk
        self._sdk: SkyPilotSdk | None = None
        self._clock = clock
        self._status = ClusterStatus(
            self._config.namespace,
            clock=clock,
            refresh_interval=self._config.refresh_interval,
            refresh_timeout=self._config.refresh_timeout,
            nonspot_refresh_gap=self._config.nonspot_refresh_gap,
        )
        self._downs: dict[str, asyncio.Task[None]] = {}
        self._preempted: dict[str, set[tuple[str, ...]]] = {}  # service -> locations

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def sdk(self) -> SkyPilotSdk:
        if self._sdk is None:
            raise BackendError("the skypilot backend is not started")
        return self._sdk

    def watch(self, wake: Callable[[], None]) -> None:
        """Call `wake` whenever a status refresh changed what `exited`/`preemption` say."""
        self._status.watch(wake)

    async def start(self) -> None:
        """Make the SDK adapter (SkyPilotMissing when SkyPilot is not installed), list the
        namespace's clusters once (so adoption sees them), start the refresher."""
        if self._sdk is not None:
            return
        self._sdk = self._make_sdk()
        await self._status.start(self._sdk)

    async def aclose(self) -> None:
        """Stop the refresher and background teardowns (SkyPilot finishes those it accepted)."""
        refresher = self._status.stop()
        tasks = [t for t in (refresher, *self._downs.values()) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._downs.clear()
        if self._sdk is not None:
            await self._sdk.aclose()
            self._sdk = None

    # -- launch ------------------------------------------------------------------------------

    async def launch(
        self, service: str, replica_id: int, version: int, spec: ServiceSpec, *, spot: bool = False
    ) -> Launched:
        """Launch the replica's cluster and wait until it is UP; raise LaunchFailed."""
        port = spec.replica_port
        if port is None:
            raise LaunchFailed(
                "the skypilot backend needs the replica's port: set service.ports "
                "(or a single resources.ports)"
            )
        name = cluster_name(self._config.namespace, service, replica_id, version)
        on_demand = spec.resources.use_spot and not spot
        task = self._task(service, replica_id, spec, port=port, on_demand=on_demand)
        request_id, info, endpoints = await self._bring_up(name, task)
        endpoint = endpoints.get(port)
        if endpoint is None:
            await self._abandon(name, None)
            raise LaunchFailed(f"cluster {name} exposes no endpoint for port {port}")
        spot_now = info.spot if info.spot is not None else spec.resources.use_spot and not on_demand
        handle = self._handle(name, service, info, request_id=request_id, port=port,
                              spot=bool(spot_now))  # fmt: skip
        self._status.record(name, info, endpoints)
        log.info("service %s: replica %d (v%d) on cluster %s (%s)", service, replica_id, version,
                 name, infra_text(handle) or "unknown infra")  # fmt: skip
        return Launched(url=replica_url(endpoint), handle=handle)

    def _task(
        self, service: str, replica_id: int, spec: ServiceSpec, *, port: int, on_demand: bool
    ) -> dict[str, Any]:
        """The replica's SkyPilot task, steered away from preempted places (the placer)."""
        placer = spec.service.scaling.spot_placer == "dynamic_fallback"
        avoid = self._preempted.get(service, set()) if placer and not on_demand else set()
        return task_config(spec, replica_id=replica_id, port=port, on_demand=on_demand,
                           base_dir=self._config.base_dir, avoid=avoid)  # fmt: skip

    async def _bring_up(
        self, name: str, task: Mapping[str, Any]
    ) -> tuple[str, ClusterInfo, dict[int, str]]:
        """Launch (with retries) and describe cluster `name`, within `launch_timeout`; any
        failure or cancellation tears it down. (request id, cluster, endpoints)."""
        cfg = self._config
        self._status.launching.add(name)
        request_id: str | None = None
        try:
            async with asyncio.timeout(cfg.launch_timeout):
                request_id = await self._launch_with_retries(name, task)
                info, endpoints = await self._describe(name)
                return request_id, info, endpoints
        except TimeoutError:
            await self._abandon(name, request_id)
            raise LaunchFailed(
                f"SkyPilot did not bring cluster {name} up within {cfg.launch_timeout:g}s "
                "(torn down)"
            ) from None
        except SdkError as exc:
            await self._abandon(name, None)
            raise LaunchFailed(f"SkyPilot could not launch cluster {name}: {exc}") from exc
        except Exception as exc:  # a bug here must not leave a machine running either
            await self._abandon(name, request_id)
            raise LaunchFailed(f"launching cluster {name} failed: {exc!r}") from exc
        except asyncio.CancelledError:
            await self._abandon(name, request_id)
            raise
        finally:
            self._status.launching.discard(name)

    def _handle(
        self, name: str, service: str, info: ClusterInfo, *, request_id: str | None, port: int,
        spot: bool | None,
    ) -> Handle:  # fmt: skip
        """What the replica record keeps of its cluster."""
        return {
            "cluster": name, "service": service, "request_id": request_id, "port": port,
            "launched": self._clock(), "spot": spot, "cloud": info.cloud,
            "region": info.region, "zone": info.zone, "instance_type": info.instance_type,
            "accelerators": info.accelerators, "price": info.hourly_price,
            "resources": info.resources,
        }  # fmt: skip

    async def _launch_with_retries(self, name: str, task: Mapping[str, Any]) -> str:
        cfg = self._config
        attempt = 0
        while True:
            request_id = await self.sdk.launch(task, name)
            try:
                await self.sdk.wait(request_id)
                return request_id
            except asyncio.CancelledError:
                await self._cancel_request(request_id)
                raise
            except SdkError as exc:
                if not exc.retryable or attempt >= cfg.launch_retries:
                    raise
                delay = cfg.retry_backoff * 2**attempt
                log.warning("cluster %s: launch failed (%s); retrying in %gs", name, exc, delay)
                attempt += 1
                await asyncio.sleep(delay)

    async def _describe(self, name: str) -> tuple[ClusterInfo, dict[int, str]]:
        found = [c for c in await self.sdk.status([name]) if c.name == name]
        if not found or found[0].status != UP:
            state = found[0].status if found else "missing"
            raise SdkError(f"cluster {name} is {state} after its launch finished")
        return found[0], await self.sdk.endpoints(name)

    async def _abandon(self, name: str, request_id: str | None) -> None:
        """Cancel the launch request and ask SkyPilot to tear the cluster down, without
        waiting for the teardown (bounded: this also runs on cancellation). If SkyPilot
        does not take the request, a background teardown keeps trying."""
        try:
            async with asyncio.timeout(self._config.submit_timeout):
                if request_id is not None:
                    await self._cancel_request(request_id)
                await self.sdk.down(name, wait=False)
        except ClusterGone:
            pass
        except Exception as exc:
            log.warning("cluster %s: teardown after a failed launch: %s; retrying", name,
                        exc or "timeout")  # fmt: skip
            self._background_down(name)

    async def _cancel_request(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._config.submit_timeout):
                await asyncio.shield(self.sdk.cancel(request_id))

    # -- adoption ----------------------------------------------------------------------------

    def recover(self, service: str, replica_id: int) -> Launched | None:
        """The UP cluster of this replica (any version), if the last listing saw one with
        exactly one exposed port."""
        found = self._status.adoptable(service, replica_id)
        if found is None:
            return None
        name, info, port, endpoint = found
        handle = self._handle(name, service, info, request_id=None, port=port,
                              spot=info.spot)  # fmt: skip
        log.info("service %s: adopted cluster %s as replica %d", service, name, replica_id)
        return Launched(url=replica_url(endpoint), handle=handle)

    def sweep(self, recorded: Mapping[str, Collection[int]]) -> None:
        """Tear down this namespace's clusters that no replica record owns.

        `recorded`: every service in Redis -> the ids of its replica records (launches
        in flight included). A cluster of a service not in `recorded` is torn down too.
        Only clusters named by `cluster_name` are touched.
        """
        for name, why in self._status.orphans(recorded, busy=self._downs.keys()):
            log.warning("cluster %s: tearing down (%s)", name, why)
            self._background_down(name)

    def _background_down(self, name: str) -> None:
        task = asyncio.create_task(self._down(name), name=f"skypilot down {name}")
        self._downs[name] = task

        def done(t: asyncio.Task[None]) -> None:
            self._downs.pop(name, None)
            if not t.cancelled() and (exc := t.exception()) is not None:
                log.error("cluster %s: %s", name, exc)

        task.add_done_callback(done)

    # -- liveness ----------------------------------------------------------------------------

    def exited(self, handle: Handle) -> str | None:
        """Why the replica's cluster is gone or stopped, per the last listing that began after
        its launch; None while it is UP, or INIT (SkyPilot's "unhealthy": the probes judge
        an on-demand replica then), or not listed since."""
        reason = self._status.not_up(handle)
        if reason is not None and reason.endswith(f" is {INIT}"):
            return None
        return reason

    def preemption(self, handle: Handle) -> str | None:
        """For a spot replica: why it counts as preempted (its cluster is gone or not UP),
        remembering where for `spot_placer: dynamic_fallback`; None otherwise."""
        if not handle.get("spot"):
            return None
        reason = self._status.not_up(handle)  # Sky Serve: a spot cluster not UP was preempted
        if reason is not None:
            service = handle.get("service")
            place = location_of(handle)
            if isinstance(service, str) and place:
                self._preempted.setdefault(service, set()).add(place)
        return reason

    def preempted_locations(self, service: str) -> set[tuple[str, ...]]:
        """Where spot replicas of `service` were preempted (what the placer avoids)."""
        return set(self._preempted.get(service, ()))

    def suspect(self, handle: Handle) -> None:
        """A probe of this replica failed: refresh its cluster's status from the cloud now
        (spot), or at most every `nonspot_refresh_gap` (on-demand)."""
        self._status.suspect(handle)

    # -- termination -------------------------------------------------------------------------

    async def terminate(self, handle: Handle) -> None:
        """`sky.down` the cluster, retried with backoff; a missing cluster is done."""
        name = handle.get("cluster")
        if not isinstance(name, str):
            return
        await self._down(name)

    async def _down(self, name: str) -> None:
        cfg = self._config
        last: Exception | None = None
        for attempt in range(max(1, cfg.down_retries)):
            try:
                async with asyncio.timeout(cfg.down_timeout):
                    await self.sdk.down(name)
            except ClusterGone:
                pass
            except (SdkError, TimeoutError) as exc:
                last = exc
                log.warning("cluster %s: sky.down failed (%s)", name, exc or "timeout")
                if attempt + 1 < cfg.down_retries:
                    await asyncio.sleep(cfg.down_backoff * 2**attempt)
                continue
            self._status.forget(name)
            return
        raise BackendError(f"sky.down of cluster {name} failed {cfg.down_retries} times: {last}")
