"""A FAKE SkyPilot, for tests only: local processes stand in for clusters.

`FakeSkyPilot` implements `controlplane.backends.skypilot_sdk.SkyPilotSdk` (the
adapter the SkyPilot backend talks to) and plays the cloud behind it. It
outlives controllers (its `aclose` keeps every "cluster"), as a cloud does; the
test's fixture calls `shutdown()` to kill what is left.

- launch: after `launch_delay`, runs the task's `run` with `bash -c` in its
  workdir, with the task's envs and `PORT` set to a free 127.0.0.1 port (the
  cluster's "service port" maps to it, as a cloud's endpoint would); the
  cluster is UP. Location: the first `ordered`/`any_of` entry's infra, else the
  task's, else `fake/fake-region-1/fake-zone-a`.
- status: UP / STOPPED / missing. A preempted cluster still shows UP until a
  refresh (`refresh=True`), like SkyPilot's cached status.
- injected failures: `fail_launches` (SdkError per launch attempt, in order),
  `fail_after_up` (the same, raised once the cluster is UP: a failed setup),
  `hang_launches` (a launch that never finishes until cancelled),
  `fail_downs` (that many `down` calls fail), `preempt(name)`, `stop(name)`.
- `events`: what happened, in order: ("launch", name), ("up", name),
  ("down", name), ("cancel", request id), ("preempt", name).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from controlplane.backends.skypilot_sdk import (
    UP,
    ClusterGone,
    ClusterInfo,
    SdkError,
)
from tests.support.ports import free_port


@dataclass
class FakeCluster:
    name: str
    task: dict[str, Any]
    status: str
    service_port: int
    port: int
    process: asyncio.subprocess.Process | None
    log: Path
    spot: bool
    location: tuple[str, str, str]
    preempted: bool = False


@dataclass
class _Request:
    id: str
    name: str
    task: asyncio.Task[None]


def _location(task: Mapping[str, Any]) -> tuple[str, str, str]:
    resources = task.get("resources") or {}
    entries = resources.get("ordered") or resources.get("any_of") or [resources]
    infra = str(entries[0].get("infra") or resources.get("infra") or "")
    parts = [p for p in infra.split("/") if p]
    default = ("fake", "fake-region-1", "fake-zone-a")
    return tuple((parts + list(default[len(parts):]))[:3]) if parts else default  # type: ignore[return-value]


def _service_port(task: Mapping[str, Any]) -> int:
    ports = (task.get("resources") or {}).get("ports")
    first = ports[0] if isinstance(ports, list) else ports
    return int(str(first).split("-")[0])


@dataclass
class FakeSkyPilot:
    """A fake SkyPilot API server plus cloud; see the module docstring."""

    log_dir: Path
    launch_delay: float = 0.0
    endpoint_path: str = ""  # e.g. "/skypilot/ns/cluster": ingress-style URL endpoints
    fail_launches: list[SdkError] = field(default_factory=list)
    hang_launches: int = 0
    fail_after_up: list[SdkError] = field(default_factory=list)  # e.g. setup failed
    fail_downs: int = 0
    clusters: dict[str, FakeCluster] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)  # cluster -> last task
    launches: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    forced: list[list[str]] = field(default_factory=list)  # clusters of each refresh=True
    listings: int = 0  # status calls without refresh
    _requests: dict[str, _Request] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def __call__(self) -> FakeSkyPilot:
        """The backend's SDK factory: every controller talks to this one fake."""
        return self

    # -- the SkyPilotSdk protocol ------------------------------------------------------------

    async def launch(self, task: Mapping[str, Any], cluster_name: str) -> str:
        request_id = f"fake-req-{next(self._ids)}"
        copied = dict(task)
        self.events.append(("launch", cluster_name))
        self.launches.append((cluster_name, copied))
        self.tasks[cluster_name] = copied
        work = asyncio.create_task(self._provision(cluster_name, copied))
        self._requests[request_id] = _Request(request_id, cluster_name, work)
        return request_id

    async def wait(self, request_id: str) -> None:
        request = self._requests[request_id]
        try:
            await asyncio.shield(request.task)
        except asyncio.CancelledError:
            if request.task.cancelled():
                raise SdkError(f"request {request_id} was cancelled") from None
            raise

    async def cancel(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None and not request.task.done():
            self.events.append(("cancel", request_id))
            request.task.cancel()
            with contextlib.suppress(BaseException):
                await request.task

    async def status(
        self, cluster_names: Sequence[str] | None = None, *, refresh: bool = False
    ) -> list[ClusterInfo]:
        if not refresh:
            self.listings += 1
        else:
            self.forced.append(sorted(cluster_names or self.clusters))
            for name in list(cluster_names or self.clusters):
                cluster = self.clusters.get(name)
                if cluster is not None and cluster.preempted:
                    del self.clusters[name]  # the cloud took the spot instance back
        names = set(cluster_names) if cluster_names is not None else None
        return [
            ClusterInfo(
                name=c.name,
                status=c.status,
                cloud=c.location[0],
                region=c.location[1],
                zone=c.location[2],
                instance_type="fake-1x",
                accelerators=None,
                spot=c.spot,
                hourly_price=0.25 if c.spot else 1.0,
                resources="1x(fake-1x)",
            )
            for c in self.clusters.values()
            if names is None or c.name in names
        ]

    async def endpoints(self, cluster_name: str) -> dict[int, str]:
        cluster = self.clusters.get(cluster_name)
        if cluster is None:
            raise ClusterGone(f"Cluster {cluster_name!r} does not exist.")
        if self.endpoint_path:
            return {cluster.service_port: f"http://127.0.0.1:{cluster.port}{self.endpoint_path}"}
        return {cluster.service_port: f"127.0.0.1:{cluster.port}"}

    async def down(self, cluster_name: str, *, wait: bool = True) -> None:
        if self.fail_downs > 0:
            self.fail_downs -= 1
            raise SdkError(f"fake: sky.down {cluster_name} failed (injected)")
        cluster = self.clusters.pop(cluster_name, None)
        if cluster is None:
            raise ClusterGone(f"Cluster {cluster_name!r} does not exist.")
        self.events.append(("down", cluster_name))
        await self._kill(cluster)

    async def tail_logs(self, cluster_name: str, *, follow: bool, out: TextIO) -> int:
        cluster = self.clusters.get(cluster_name)
        if cluster is None:
            raise ClusterGone(f"Cluster {cluster_name!r} does not exist.")
        out.write(cluster.log.read_text())
        return 0

    async def aclose(self) -> None:
        """A controller closed its client: the clusters stay (the cloud keeps them)."""

    # -- injections --------------------------------------------------------------------------

    async def preempt(self, cluster_name: str) -> None:
        """The cloud takes the spot machine: the process dies; status says UP until a
        refresh, then the cluster is gone."""
        cluster = self.clusters[cluster_name]
        self.events.append(("preempt", cluster_name))
        cluster.preempted = True
        await self._kill(cluster)

    async def stop(self, cluster_name: str) -> None:
        cluster = self.clusters[cluster_name]
        cluster.status = "STOPPED"
        await self._kill(cluster)

    async def add_running(self, cluster_name: str, task: Mapping[str, Any]) -> None:
        """A cluster some controller launched and never recorded."""
        await self._start(cluster_name, dict(task))

    def names(self) -> list[str]:
        return sorted(self.clusters)

    def up_names(self) -> list[str]:
        return sorted(n for n, c in self.clusters.items() if c.status == UP and not c.preempted)

    async def shutdown(self) -> None:
        for request in self._requests.values():
            request.task.cancel()
        for request in self._requests.values():
            with contextlib.suppress(BaseException):
                await request.task
        for cluster in list(self.clusters.values()):
            await self._kill(cluster)
        self.clusters.clear()

    # -- internals ---------------------------------------------------------------------------

    async def _provision(self, name: str, task: dict[str, Any]) -> None:
        await asyncio.sleep(self.launch_delay)
        if self.hang_launches > 0:
            self.hang_launches -= 1
            await asyncio.Event().wait()  # until cancelled
        if self.fail_launches:
            raise self.fail_launches.pop(0)
        existing = self.clusters.get(name)
        if existing is not None and existing.status == UP and not existing.preempted:
            return  # sky.launch on an UP cluster reuses it
        await self._start(name, task)
        if self.fail_after_up:
            raise self.fail_after_up.pop(0)  # the machine is up: whoever launched must down it

    async def _start(self, name: str, task: dict[str, Any]) -> None:
        port = free_port()
        log = self.log_dir / f"{name}.log"
        env = dict(os.environ)
        for key in ("envs", "secrets"):
            env.update({k: str(v) for k, v in (task.get(key) or {}).items()})
        env["PORT"] = str(port)
        with log.open("ab") as out:
            spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
                "bash", "-c", str(task.get("run") or "sleep infinity"),
                cwd=task.get("workdir") or None, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
            try:
                process = await asyncio.shield(spawn)
            except asyncio.CancelledError:
                # Cancelled mid-spawn: the process may exist already; never leak it.
                with contextlib.suppress(BaseException):
                    orphan = await spawn
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(orphan.pid, signal.SIGKILL)
                    await orphan.wait()
                raise
        previous = self.clusters.get(name)
        if previous is not None:
            await self._kill(previous)
        resources = task.get("resources") or {}
        self.clusters[name] = FakeCluster(
            name=name,
            task=task,
            status=UP,
            service_port=_service_port(task),
            port=port,
            process=process,
            log=log,
            spot=bool(resources.get("use_spot", False)),
            location=_location(task),
        )
        self.events.append(("up", name))

    async def _kill(self, cluster: FakeCluster) -> None:
        process, cluster.process = cluster.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
