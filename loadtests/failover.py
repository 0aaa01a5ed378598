"""The `redis-failover` scenario of loadtests/rollout.py: the whole fleet through a
Redis primary failover.

    python loadtests/rollout.py --scenario redis-failover

On 127.0.0.1: a Redis primary, one replica and three sentinels (`SentinelGroup`,
`redis-server --sentinel`), 4 proxies with 2 workers each (8 proxy processes, each
following Redis on its own) with locust spreading its requests over the 4, and 2
controllers (a leader and a standby), all given the `redis+sentinel://` URL. Under
load: SIGKILL the primary (the sentinels promote the replica), a count-only update
2 -> 3, SIGKILL the leading controller (the standby takes over), a rolling update.

Besides rollout.py's request table it reports convergence, from the proxies' own
heartbeats (`{p}:svc:llm:proxies`: each process's last 32 applies with their times)
and the commits' `published_at`: per proxy process the generation timeline, and
per commit the time until all 8 processes applied it (p50/p99/max). A generation
that a process skipped (a newer one reached it first, e.g. by the GET after a
reconnect) is counted as superseded, not as applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

import aiohttp

from controlplane import ops
from controlplane.processes import free_port
from controlplane.states import UpdateMode
from controlplane.store import Store, StoreError
from loadtests.rollout import SERVE_PAUSE, SERVICE, Expected, Options, Processes, Stack
from tests.support.sentinel import SentinelGroup

PROXIES = 4
WORKERS = 2
CONTROLLERS = 2


class FailoverStack(Stack):
    """Stack with a Sentinel-managed Redis, 4 proxies x 2 workers and 2 controllers."""

    def __init__(self, options: Options, state_dir: Any, processes: Processes) -> None:
        super().__init__(options, state_dir, processes)
        self.group = SentinelGroup(state_dir / "redis", service="sluice", persist=True)
        self.ports: list[int] = []
        self.admin_ports: list[int] = []
        self.proxies: list[Any] = []
        self.leaders: dict[str, Any] = {}  # holder -> controller process
        self.commits: dict[int, float] = {}  # generation -> published_at
        self.applies: dict[str, dict[int, float]] = {}  # proxy id -> generation -> applied_at
        self._watch: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None

    @property
    def redis_url(self) -> str:
        return self.group.url

    @property
    def endpoint(self) -> str:
        return ",".join(f"http://127.0.0.1:{port}" for port in self.ports) or "http://-"

    async def start(self, replicas: int) -> None:
        self.processes.handle_dirs.append(self.state_dir / SERVICE)
        try:
            self.group.start()  # from the main thread: the servers die with this one
        finally:
            self.processes.redis += [*self.group.nodes, *self.group.sentinels]
        self.store = Store.from_url(self.group.url, socket_timeout=2.0)
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        for _ in range(CONTROLLERS):
            self.start_controller()
        taken: set[int] = set()
        for i in range(PROXIES):
            # Worker i serves its admin listener on admin + i.
            port, admin = _listen_port(taken), _listen_port(taken, span=WORKERS)
            self.ports.append(port)
            self.admin_ports.append(admin)
            self.proxies.append(self.processes.spawn(
                [sys.executable, "-m", "proxy.cli", "--redis", self.group.url,
                 "--service", SERVICE, "--host", "127.0.0.1", "--port", str(port),
                 "--admin-port", str(admin), "--workers", str(WORKERS),
                 "--shutdown-grace", "5", "--log-level", "info"],
                self.state_dir / f"proxy-{i}.log"))  # fmt: skip
        self.proxy = self.proxies[0]
        self.admin_port = self.admin_ports[0]
        await self._until(self._proxy_up, 60, "the proxies to listen")
        await ops.up(self.store, SERVICE, _spec(self.options, replicas),
                     endpoint=f"http://127.0.0.1:{self.ports[0]}")  # fmt: skip
        self._watch = asyncio.create_task(self._watch_convergence(), name="convergence")
        self._follow = asyncio.create_task(self._follow_commits(), name="commits")
        await self.settled(replicas)

    def start_controller(self) -> None:
        super().start_controller()
        self.leaders[f"loadtest-controller-{self.controllers}"] = self.controller

    async def aclose(self) -> list[str]:
        for task in (self._watch, self._follow):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        issues: list[str] = []
        try:
            await self.stop_load()
        finally:
            try:
                for proc in self.proxies:
                    if not await self._stop(proc, 10):
                        issues.append("a proxy ignored SIGTERM for 10s (killed)")
                grace = self.options.drain_seconds + 15
                for proc in self.leaders.values():
                    if not await self._stop(proc, grace):
                        issues.append(f"a controller ignored SIGTERM for {grace:g}s (killed)")
            finally:
                if left := self.processes.kill_replicas():
                    issues.append(f"the controllers left {left} replicas running (killed)")
                if self.http is not None:
                    await self.http.close()
                if self.store is not None:
                    await self.store.aclose()
                self.group.stop()
        return issues

    # -- verbs ------------------------------------------------------------------------------

    async def kill_primary(self) -> None:
        old = self.group.primary_port()
        self.mark(f"SIGKILL the Redis primary (port {old})")
        new = await asyncio.to_thread(self.group.kill_primary)
        self.mark(f"sentinels promoted the replica (port {new})")

    async def kill_leader(self) -> None:
        holder = await self.lease_holder()
        # The lease names `--holder` plus the random token each controller appends.
        name = (holder or "").rpartition(":")[0]
        proc = self.leaders.get(name)
        if proc is None:
            raise RuntimeError(f"no controller of ours holds the lease ({holder!r})")
        proc.kill()
        proc.wait()
        self.mark(f"SIGKILL the leading controller {holder} (pid {proc.pid})")

        async def standby_leads() -> bool:
            with contextlib.suppress(StoreError):
                return await self.lease_holder() not in (None, holder)
            return False

        await self._until(standby_leads, self.options.lease_ttl + 30, "the standby to lead")
        self.mark(f"{await self.lease_holder()} leads")

    # -- convergence ------------------------------------------------------------------------

    async def _follow_commits(self) -> None:
        """Record every commit's published_at (subscribed, as a proxy; again after a
        failover)."""
        assert self.store is not None
        while True:
            with contextlib.suppress(StoreError):
                async for snap in self.store.follow_snapshots(SERVICE, resync_interval=0.5):
                    self.commits.setdefault(snap.generation, snap.published_at)
            await asyncio.sleep(0.1)

    async def _watch_convergence(self) -> None:
        """Record every proxy's applies (their heartbeats keep the last 32)."""
        assert self.store is not None
        while True:
            with contextlib.suppress(StoreError):
                for proxy_id, beat in (await self.store.telemetry.read_proxies(SERVICE)).items():
                    applied = self.applies.setdefault(proxy_id, {})
                    for generation, at in beat.recent:
                        applied.setdefault(generation, at)
            await asyncio.sleep(0.1)

    async def convergence(self) -> dict[str, Any]:
        """Per commit since the load began, the time until all proxy processes applied it."""
        assert self.store is not None
        await asyncio.sleep(2.5)  # two heartbeats (1 s each) after the last commit
        with contextlib.suppress(StoreError):
            for proxy_id, beat in (await self.store.telemetry.read_proxies(SERVICE)).items():
                applied = self.applies.setdefault(proxy_id, {})
                for generation, at in beat.recent:
                    applied.setdefault(generation, at)
        start = self.load_started or 0.0
        # Every generation any process applied is a commit; its time is from the snapshot
        # we saw (a commit published while we were reconnecting has none: left out).
        gens = sorted({g for applied in self.applies.values() for g in applied})
        procs = sorted(self.applies)
        rows, delays, superseded = [], [], 0
        for g in gens:
            published = self.commits.get(g)
            if published is None or published < start:
                continue
            times = [self.applies[p].get(g) for p in procs]
            if any(t is None for t in times):
                superseded += 1
                rows.append({"generation": g, "at": round(published - start, 2),
                             "all_applied_ms": None,
                             "applied_by": sum(t is not None for t in times)})
                continue
            delay = max(t for t in times if t is not None) - published
            delays.append(delay)
            rows.append({"generation": g, "at": round(published - start, 2),
                         "all_applied_ms": round(delay * 1000, 1), "applied_by": len(procs)})
        timelines = {p: [(g, round(t - start, 2)) for g, t in sorted(self.applies[p].items())
                         if t >= start] for p in procs}  # fmt: skip
        return {
            "processes": len(procs),
            "commits": rows,
            "superseded": superseded,
            "all_applied_ms": _percentiles(delays),
            "timelines": timelines,
        }

    def _worker_admins(self) -> list[int]:
        return [admin + i for admin in self.admin_ports for i in range(WORKERS)]

    async def _proxy_up(self) -> bool:
        assert self.http is not None
        for admin in self._worker_admins():
            try:
                async with self.http.get(f"http://127.0.0.1:{admin}/healthz") as resp:
                    if resp.status != 200:
                        return False
            except (aiohttp.ClientError, TimeoutError):
                return False
        return True

    async def _proxy_routes(self, n: int) -> bool:
        assert self.http is not None
        for admin in self._worker_admins():
            try:
                async with self.http.get(f"http://127.0.0.1:{admin}/readyz") as resp:
                    body = await resp.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return False
            if int(body.get("replicas", -1)) != n:
                return False
        return True


def _listen_port(taken: set[int], span: int = 1) -> int:
    """The first of `span` consecutive free ports, below the ephemeral range: worker i
    listens for admin on admin + i, a port nobody checked, and an outgoing connection
    of the many here may take an ephemeral one as its source port first (seen: a worker
    failing with "address already in use", restarted by its supervisor)."""
    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(1000):
        first = random.randrange(max(1024, low - 20000), low - span)
        ports = range(first, first + span)
        if taken.intersection(ports) or not all(_bindable(p) for p in ports):
            continue
        taken.update(ports)
        return first
    return free_port()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _spec(options: Options, replicas: int, revision: int = 1) -> Any:
    from loadtests.rollout import service_spec

    return service_spec(options, replicas, revision=revision)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))]
    return {"n": len(ordered), "p50": round(statistics.median(ordered) * 1000, 1),
            "p99": round(p99 * 1000, 1), "max": round(ordered[-1] * 1000, 1)}


async def redis_failover(stack: Stack) -> Expected:
    assert isinstance(stack, FailoverStack)
    await stack.kill_primary()
    await stack.update(3)  # count-only, committed on the new primary
    await stack.settled(3)
    await asyncio.sleep(SERVE_PAUSE)
    await stack.kill_leader()
    version = await stack.update(3, revision=2, mode=UpdateMode.ROLLING)
    await stack.settled(3, version=version)
    await asyncio.sleep(SERVE_PAUSE)
    stack.convergence_report = await stack.convergence()  # type: ignore[attr-defined]
    # 2 -> 3 launches one; the rolling update replaces all 3. Anything more is needless.
    return Expected(launched=4, terminated=3)


def convergence_table(report: dict[str, Any]) -> str:
    """The per-commit and per-process convergence lines of the scenario's table."""
    if not report:
        return "   convergence: not measured"
    pct = report["all_applied_ms"]
    lines = [
        f"   convergence over {report['processes']} proxy processes: commit -> applied by all "
        f"p50 {pct['p50']} ms, p99 {pct['p99']} ms, max {pct['max']} ms "
        f"({pct['n']} commits; {report['superseded']} superseded before all applied them)",
        "   commits (s from load start: generation, ms until all applied):",
        "     " + ", ".join(
            f"+{r['at']}s g{r['generation']}: "
            + (f"{r['all_applied_ms']}" if r["all_applied_ms"] is not None
               else f"superseded ({r['applied_by']}/{report['processes']})")
            for r in report["commits"]),
        "   generation timeline per proxy process (generation@s from load start):",
    ]
    for proxy_id, timeline in report["timelines"].items():
        lines.append(f"     {proxy_id:<16} " + " ".join(f"{g}@{t}" for g, t in timeline))
    return "\n".join(lines)

