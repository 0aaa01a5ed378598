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

Liveness: `exited()` answers from a cache of `sky.status` that a background
task (owned here, cancelled by `aclose`) refreshes every `refresh_interval`,
and at once for clusters the controller suspects (`suspect()`: a failed probe;
a forced cloud refresh, at most every `nonspot_refresh_gap` for on-demand
clusters). A spot cluster that is gone or not UP is a preemption
(`preemption()`); `spot_placer: dynamic_fallback` remembers where preemptions
happened and steers the next spot launches to the task's other `any_of` /
`ordered` locations (`task_config`). Without such a list SkyPilot's own
optimizer picks, as in any launch: sluice cannot enumerate locations offline.

Termination: `sky.down`, idempotent (a missing cluster is done), retried with
backoff; it runs in the controller's termination task, never in a step.

Adoption: `recover()` finds the UP cluster of a replica whose launch a dead
controller left unrecorded; `sweep()` (given every recorded replica id per
service) tears down clusters of this namespace that no record owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import logging
import re
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
from controlplane.records import Handle
from controlplane.spec import ServiceSpec

log = logging.getLogger("sluice.backend.skypilot")

#: SkyPilot's cluster-name rule (sky.skylet.constants.CLUSTER_NAME_VALID_REGEX).
CLUSTER_NAME_RE = re.compile(r"[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?")
_MAX_SLUG = 40  # keeps names short enough to read; SkyPilot shortens them per cloud itself
_TASK_KEYS = ("name", "run", "setup", "envs", "secrets", "workdir", "resources", "num_nodes",
              "file_mounts", "config", "volumes")  # fmt: skip


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


# -- names ---------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    """`text` within the cluster-name alphabet; a hash suffix when anything changed."""
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", text).strip("-").lower()
    if slug != text or len(slug) > _MAX_SLUG:
        digest = hashlib.sha256(text.encode()).hexdigest()[:6]
        slug = f"{slug[: _MAX_SLUG - 7]}-{digest}".strip("-")
    return slug


def cluster_prefix(namespace: str, service: str) -> str:
    """Every cluster of `service` starts with this (followed by `-r{id}-v{version}`)."""
    ns = _slug(namespace) or "sluice"
    if not ns[0].isalpha():
        ns = f"s{ns}"
    return f"{ns}-{_slug(service)}"


def cluster_name(namespace: str, service: str, replica_id: int, version: int) -> str:
    """The cluster of one replica; matches SkyPilot's CLUSTER_NAME_RE."""
    return f"{cluster_prefix(namespace, service)}-r{replica_id}-v{version}"


def parse_cluster(prefix: str, name: str) -> tuple[int, int] | None:
    """(replica id, version) of a cluster named by `cluster_name` with `prefix`, else None."""
    m = re.fullmatch(rf"{re.escape(prefix)}-r([0-9]+)-v([0-9]+)", name)
    return (int(m[1]), int(m[2])) if m else None


def replica_url(endpoint: str) -> str:
    """The replica URL from a SkyPilot endpoint: `host:port` gets `http://`; a URL (a
    Kubernetes ingress endpoint with its path prefix) is kept as it is."""
    endpoint = endpoint.strip()
    if re.match(r"^https?://", endpoint):
        return endpoint.rstrip("/")
    return f"http://{endpoint}".rstrip("/")


# -- the task ------------------------------------------------------------------------------------


def location_of(entry: Mapping[str, Any]) -> tuple[str, ...]:
    """(cloud, region, zone) of a resources entry or handle, as far as it says, lowercase."""
    infra = entry.get("infra")
    if isinstance(infra, str) and infra:
        parts = [p for p in infra.split("/") if p]
        if parts and parts[0].lower() in ("k8s", "kubernetes"):
            return ("kubernetes", *parts[1:2])
        return tuple(p.lower() for p in parts[:3])
    out: list[str] = []
    for part in (entry.get(k) for k in ("cloud", "region", "zone")):
        if not part:
            break
        out.append(str(part).lower())
    return tuple(out)


def _covers(entry: tuple[str, ...], place: tuple[str, ...]) -> bool:
    """True when a resources entry for `entry` could land in `place` (a preempted spot)."""
    return bool(entry) and place[: len(entry)] == entry


def task_config(
    spec: ServiceSpec,
    *,
    replica_id: int,
    port: int,
    on_demand: bool = False,
    base_dir: Path | None = None,
    avoid: Collection[tuple[str, ...]] = (),
) -> dict[str, Any]:
    """The SkyPilot task (YAML mapping) for one replica of `spec`; see the module docstring.

    `avoid`: locations where spot replicas were preempted; entries of
    `resources.ordered` there move to the end, entries of `resources.any_of` there
    are left out (nothing changes when every entry was preempted somewhere: Sky
    Serve's placer then starts over too).
    """
    raw: dict[str, Any] = {
        k: v for k, v in _plain(spec).items() if k in _TASK_KEYS and v not in (None, {}, [])
    }
    if raw.get("num_nodes") == 1:
        del raw["num_nodes"]
    resources: dict[str, Any] = {k: v for k, v in raw.get("resources", {}).items()
                                 if v is not None and k != "use_spot"}  # fmt: skip
    if spec.resources.use_spot:
        resources["use_spot"] = not on_demand
    ports = [str(p) for p in _as_list(resources.get("ports"))]
    if not any(_port_in(port, p) for p in ports):
        ports.insert(0, str(port))
    resources["ports"] = ports if len(ports) > 1 else int(ports[0]) if ports[0].isdigit() else ports
    for key in ("any_of", "ordered"):
        entries = resources.get(key)
        if not entries:
            continue
        entries = [dict(e) for e in entries]
        if on_demand:
            for entry in entries:
                if "use_spot" in entry:
                    entry["use_spot"] = False
        if avoid:
            fresh = [e for e in entries if not any(_covers(location_of(e), a) for a in avoid)]
            stale = [e for e in entries if e not in fresh]
            if fresh and stale:
                # `ordered`: the fresh locations first. `any_of` has no order, and SkyPilot
                # refuses `ordered` beside several accelerators: leave the stale ones out.
                entries = fresh + stale if key == "ordered" else fresh
        resources[key] = entries
    raw["resources"] = resources
    if spec.workdir is not None and base_dir is not None:
        raw["workdir"] = str(base_dir / spec.workdir)
    envs = dict(spec.envs)
    envs.setdefault("PORT", str(port))
    envs["SLUICE_REPLICA_ID"] = str(replica_id)
    envs["SKYPILOT_SERVE_REPLICA_ID"] = str(replica_id)
    raw["envs"] = envs
    return raw


def _plain(spec: ServiceSpec) -> dict[str, Any]:
    import msgspec

    data: dict[str, Any] = msgspec.to_builtins(spec)
    data.pop("service", None)
    return copy.deepcopy(data)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _port_in(port: int, spec: str) -> bool:
    lo, sep, hi = spec.partition("-")
    try:
        return int(lo) <= port <= int(hi if sep else lo)
    except ValueError:
        return False


# -- what `sluice status` shows -----------------------------------------------------------------


def infra_text(handle: Handle) -> str | None:
    """`AWS (us-east-1, us-east-1a)` from a handle, like Sky Serve's INFRA column."""
    cloud = handle.get("cloud")
    if not cloud:
        return None
    where = ", ".join(str(handle[k]) for k in ("region", "zone") if handle.get(k))
    return f"{cloud} ({where})" if where else str(cloud)


def resources_text(handle: Handle) -> str | None:
    """`1x[Spot](g6.xlarge, L4:1) $0.40/h` from a handle, like Sky Serve's RESOURCES column."""
    if not handle.get("cloud") and not handle.get("resources"):
        return None
    parts = [str(handle[k]) for k in ("instance_type", "accelerators") if handle.get(k)]
    spot = "[Spot]" if handle.get("spot") else ""
    text = f"1x{spot}({', '.join(parts)})" if parts else str(handle.get("resources") or "-")
    price = handle.get("price")
    if isinstance(price, int | float) and not isinstance(price, bool):
        text += f" ${price:.2f}/h"
    return text


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
        self._wake: Callable[[], None] | None = None
        self._clusters: dict[str, ClusterInfo] = {}  # this namespace's clusters, as last listed
        self._endpoints: dict[str, dict[int, str]] = {}
        self._listed_at: float | None = None  # when the listing in `_clusters` began
        self._suspects: set[str] = set()
        self._suspected_at: dict[str, float] = {}
        self._launching: set[str] = set()
        self._downs: dict[str, asyncio.Task[None]] = {}
        self._preempted: dict[str, set[tuple[str, ...]]] = {}  # service -> locations
        self._kick = asyncio.Event()
        self._refresher: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def sdk(self) -> SkyPilotSdk:
        if self._sdk is None:
            raise BackendError("the skypilot backend is not started")
        return self._sdk

    def watch(self, wake: Callable[[], None]) -> None:
        """Call `wake` whenever a status refresh changed what `exited`/`preemption` say."""
        self._wake = wake

    async def start(self) -> None:
        """Make the SDK adapter (SkyPilotMissing when SkyPilot is not installed), list the
        namespace's clusters once (so adoption sees them), start the refresher."""
        if self._sdk is not None:
            return
        self._sdk = self._make_sdk()
        try:
            await self._refresh()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("skypilot: listing clusters: %s", exc)
        self._refresher = asyncio.create_task(self._refresh_loop(), name="skypilot status")

    async def aclose(self) -> None:
        """Stop the refresher and background teardowns (SkyPilot finishes those it accepted)."""
        tasks = [t for t in (self._refresher, *self._downs.values()) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._refresher = None
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
        cfg = self._config
        name = cluster_name(cfg.namespace, service, replica_id, version)
        on_demand = spec.resources.use_spot and not spot
        placer = spec.service.scaling.spot_placer == "dynamic_fallback"
        avoid = self._preempted.get(service, set()) if placer and not on_demand else set()
        task = task_config(spec, replica_id=replica_id, port=port, on_demand=on_demand,
                           base_dir=cfg.base_dir, avoid=avoid)  # fmt: skip
        self._launching.add(name)
        request_id: str | None = None
        try:
            async with asyncio.timeout(cfg.launch_timeout):
                request_id = await self._launch_with_retries(name, task)
                info, endpoints = await self._describe(name)
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
            self._launching.discard(name)
        endpoint = endpoints.get(port)
        if endpoint is None:
            await self._abandon(name, None)
            raise LaunchFailed(f"cluster {name} exposes no endpoint for port {port}")
        handle: Handle = {
            "cluster": name,
            "service": service,
            "request_id": request_id,
            "port": port,
            "launched": self._clock(),
            "spot": bool(info.spot) if info.spot is not None else (not on_demand
                                                                   and spec.resources.use_spot),
            "cloud": info.cloud,
            "region": info.region,
            "zone": info.zone,
            "instance_type": info.instance_type,
            "accelerators": info.accelerators,
            "price": info.hourly_price,
            "resources": info.resources,
        }  # fmt: skip
        self._clusters[name] = info
        self._endpoints[name] = endpoints
        log.info("service %s: replica %d (v%d) on cluster %s (%s)", service, replica_id, version,
                 name, infra_text(handle) or "unknown infra")  # fmt: skip
        return Launched(url=replica_url(endpoint), handle=handle)

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
        prefix = cluster_prefix(self._config.namespace, service)
        for name, info in self._clusters.items():
            parsed = parse_cluster(prefix, name)
            if parsed is None or parsed[0] != replica_id or info.status != UP:
                continue
            endpoints = self._endpoints.get(name, {})
            if len(endpoints) != 1:
                return None
            ((port, endpoint),) = endpoints.items()
            handle: Handle = {
                "cluster": name, "service": service, "request_id": None, "port": port,
                "launched": self._clock(), "spot": info.spot, "cloud": info.cloud,
                "region": info.region, "zone": info.zone, "instance_type": info.instance_type,
                "accelerators": info.accelerators, "price": info.hourly_price,
                "resources": info.resources,
            }  # fmt: skip
            log.info("service %s: adopted cluster %s as replica %d", service, name, replica_id)
            return Launched(url=replica_url(endpoint), handle=handle)
        return None

    def sweep(self, recorded: Mapping[str, Collection[int]]) -> None:
        """Tear down this namespace's clusters that no replica record owns.

        `recorded`: every service in Redis -> the ids of its replica records (launches
        in flight included). A cluster of a service not in `recorded` is torn down too.
        Only clusters named by `cluster_name` are touched.
        """
        if self._listed_at is None:
            return
        namespace = re.escape(cluster_prefix(self._config.namespace, ""))
        ours = re.compile(rf"{namespace}.+-r[0-9]+-v[0-9]+")
        prefixes = {svc: cluster_prefix(self._config.namespace, svc) for svc in recorded}
        for name in list(self._clusters):
            if name in self._launching or name in self._downs:
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
        reason = self._not_up(handle)
        if reason is not None and reason.endswith(f" is {INIT}"):
            return None
        return reason

    def _not_up(self, handle: Handle) -> str | None:
        name = handle.get("cluster")
        if not isinstance(name, str):
            return "no cluster recorded"
        launched = handle.get("launched")
        if self._listed_at is None or (
            isinstance(launched, int | float) and self._listed_at < launched
        ):
            return None
        info = self._clusters.get(name)
        if info is None:
            return f"cluster {name} is gone"
        if info.status != UP:
            return f"cluster {name} is {info.status}"
        return None

    def preemption(self, handle: Handle) -> str | None:
        """For a spot replica: why it counts as preempted (its cluster is gone or not UP),
        remembering where for `spot_placer: dynamic_fallback`; None otherwise."""
        if not handle.get("spot"):
            return None
        reason = self._not_up(handle)  # Sky Serve: a spot cluster not UP was preempted
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
        name = handle.get("cluster")
        if not isinstance(name, str):
            return
        now = self._clock()
        gap = 0.0 if handle.get("spot") else self._config.nonspot_refresh_gap
        last = self._suspected_at.get(name)
        if last is not None and now - last < gap:
            return
        self._suspected_at[name] = now
        self._suspects.add(name)
        self._kick.set()

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
            self._clusters.pop(name, None)
            self._endpoints.pop(name, None)
            self._suspected_at.pop(name, None)
            return
        raise BackendError(f"sky.down of cluster {name} failed {cfg.down_retries} times: {last}")

    # -- the status cache --------------------------------------------------------------------

    async def _refresh_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._config.refresh_interval):
                    await self._kick.wait()
            self._kick.clear()
            try:
                async with asyncio.timeout(self._config.refresh_timeout):
                    await self._refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("skypilot: refreshing cluster status: %s", exc or "timeout")

    async def _refresh(self) -> None:
        began = self._clock()
        suspects, self._suspects = self._suspects, set()
        prefix = cluster_prefix(self._config.namespace, "")
        listed = {c.name: c for c in await self.sdk.status() if c.name.startswith(prefix)}
        fresh: dict[str, ClusterInfo] | None = None
        if suspects:
            try:
                forced = await self.sdk.status(sorted(suspects), refresh=True)
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
            if info.status == UP and name not in self._endpoints:
                with contextlib.suppress(SdkError):
                    self._endpoints[name] = await self.sdk.endpoints(name)
        # Launches that finished meanwhile are not in this listing: keep what they recorded.
        for name in self._launching:
            if name in self._clusters and name not in listed:
                listed[name] = self._clusters[name]
        changed = listed != self._clusters
        self._clusters = listed
        for name in [n for n in self._endpoints if n not in listed]:
            del self._endpoints[name]
        self._listed_at = began
        if changed and self._wake is not None:
            self._wake()
