"""How fast a committed ReadySnapshot reaches the proxies, and what a commit costs.

One committer (controlplane.store.Store.commit) and N proxy *processes*, each
running proxy.sources.redis.RedisSource into a ReadySet, as sluice-proxy does.
The committer commits `--commits` snapshots (2 -> 3 -> 2 replicas, every one a
new generation); each proxy records, for every snapshot it applies, the time
from the snapshot's `published_at` (set by the committer just before its
MULTI/EXEC) to the moment the ReadySet swapped it in, and reports them over a
pipe. Then it times one commit against services of 10, 100 and 1,000 replicas.
Prints tables; asserts nothing. Everything runs on 127.0.0.1 against an
embedded redis-server that is stopped at the end; proxy processes are joined,
or killed by pid.

    python bench/propagation.py [--proxies 8] [--commits 1000] [--interval 0]
    python bench/propagation.py --proxies 32 --commits 1000 --failover

Convergence: per commit, the time from its `published_at` until the LAST proxy
process applied it (p50/p99/max over the commits every proxy applied; a commit
some proxy skipped because a newer one reached it first is counted as
superseded). `--failover` measures it a second time against a Sentinel-managed
Redis (primary, replica, three sentinels; `redis+sentinel://` URL) whose primary
is SIGKILLed halfway through the commits: the committer retries through the
failover, the proxies reconnect to the promoted replica.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/propagation.py` without installing
    sys.path.insert(0, str(REPO))

import redis  # noqa: E402
import uvloop  # noqa: E402

from controlplane.records import ReplicaRecord, ServiceRecord, ServiceStatus  # noqa: E402
from controlplane.redisserver import EmbeddedRedis  # noqa: E402
from controlplane.states import ReplicaStatus  # noqa: E402
from controlplane.store import Store, StoreError  # noqa: E402
from proxy.config import ProxyConfig  # noqa: E402
from proxy.readyset import ReadySet  # noqa: E402
from proxy.sources.redis import RedisSource  # noqa: E402
from proxy.stats import Stats  # noqa: E402
from proxy.wire.snapshot import ReadySnapshot, encode_snapshot  # noqa: E402
from tests.support.pids import interrupt_on_sigterm  # noqa: E402
from tests.support.sentinel import SentinelGroup  # noqa: E402

PREFIX = "bench"
SERVICE = "prop"
COMMIT_SIZES = (10, 100, 1000)


# -- the proxy processes --------------------------------------------------------------------


class TimingReadySet(ReadySet):
    """A ReadySet noting, per applied snapshot, published_at -> applied (seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = False
        self.latencies: list[float] = []
        self.applied: list[tuple[float, float]] = []  # (published_at, applied_at)

    def apply(self, snapshot: ReadySnapshot, *, reset: bool = False) -> bool:
        applied = super().apply(snapshot, reset=reset)
        if applied and self.recording:
            now = time.time()
            self.latencies.append(now - snapshot.published_at)
            self.applied.append((snapshot.published_at, now))
        return applied


def proxy_process(url: str, conn: Connection) -> None:
    uvloop.run(_proxy(url, conn))


async def _proxy(url: str, conn: Connection) -> None:
    ready_set = TimingReadySet()
    config = ProxyConfig(redis_url=url, service=SERVICE, redis_prefix=PREFIX)
    source = RedisSource(config, Stats())
    await source.start(ready_set)
    try:
        ready_set.recording = True
        conn.send(ready_set.generation)
        loop = asyncio.get_running_loop()
        final: int = await loop.run_in_executor(None, conn.recv)
        deadline = loop.time() + 30
        while ready_set.generation < final and loop.time() < deadline:
            await asyncio.sleep(0.001)
        conn.send((ready_set.generation, ready_set.latencies, ready_set.applied))
    finally:
        await source.aclose()
        ready_set.close()


# -- the committer --------------------------------------------------------------------------


def replica(i: int, ready: bool = True) -> ReplicaRecord:
    status = ReplicaStatus.READY if ready else ReplicaStatus.NOT_READY
    return ReplicaRecord(
        id=i, status=status, url=f"http://10.0.{i // 250}.{i % 250}:8000", accelerator="A100:1"
    )


async def register(store: Store, name: str, replicas: list[ReplicaRecord]) -> None:
    record = ServiceRecord(name=name, status=ServiceStatus.READY)
    await store.register_service(record, b"{}")
    if replicas:
        await store.commit(name, replica_updates=replicas)


@dataclass
class Propagation:
    latencies: list[float]  # every proxy's published_at -> applied, pooled
    reached: list[int]  # the generation each proxy reached
    commit_times: list[float]
    converged: list[float]  # per commit applied by all: published_at -> last proxy applied
    superseded: int  # commits some proxy never applied (a newer one came first)
    failed_commits: int = 0  # commit attempts that failed during a failover (retried)
    failover_seconds: float = 0.0  # SIGKILL of the primary -> a replica promoted
    # Per commit: published_at -> every proxy applied it or a newer one (its effect).
    caught_up: list[float] = field(default_factory=list)


async def _commit(store: Store, i: int) -> tuple[ReadySnapshot, int]:
    """One commit, retried while Redis fails over; returns it and the failed attempts."""
    failed = 0
    while True:
        try:
            snap = await store.commit(SERVICE, replica_updates=[replica(3, ready=i % 2 == 0)])
            return snap, failed
        except StoreError:
            failed += 1
            await asyncio.sleep(0.05)


async def propagation(
    store: Store, url: str, proxies: int, commits: int, interval: float,
    failover: Callable[[], float] | None = None,
) -> Propagation:
    """Commit `commits` snapshots under `proxies` subscribed processes (`failover`, run
    in a thread halfway, kills the primary and returns how long the promotion took)."""
    await register(store, SERVICE, [replica(1), replica(2)])
    ctx = multiprocessing.get_context("spawn")
    pipes: list[Connection] = []
    procs = []
    try:
        for _ in range(proxies):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=proxy_process, args=(url, child), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        loop = asyncio.get_running_loop()
        for pipe in pipes:  # each proxy has loaded the current snapshot and subscribed
            await loop.run_in_executor(None, pipe.recv)
        commit_times = []
        published: list[float] = []
        failed = 0
        failing: asyncio.Future[float] | None = None
        last = None
        for i in range(commits):
            if failover is not None and i == commits // 2:
                failing = asyncio.ensure_future(asyncio.to_thread(failover))
            start = time.perf_counter()
            last, errors = await _commit(store, i)
            failed += errors
            commit_times.append(time.perf_counter() - start)
            published.append(last.published_at)
            if interval:
                await asyncio.sleep(interval)
        failover_seconds = await failing if failing is not None else 0.0
        assert last is not None
        for pipe in pipes:
            pipe.send(last.generation)
        latencies: list[float] = []
        reached: list[int] = []
        applies: list[dict[float, float]] = []
        for pipe in pipes:
            generation, lat, applied = await loop.run_in_executor(None, pipe.recv)
            reached.append(generation)
            latencies.extend(lat)
            applies.append(dict(applied))
        converged, superseded = [], 0
        for at in published:
            times = [a.get(at) for a in applies]
            if any(t is None for t in times):
                superseded += 1
            else:
                converged.append(max(t for t in times if t is not None) - at)
        return Propagation(latencies, reached, commit_times, converged, superseded, failed,
                           failover_seconds, _caught_up(published, applies))
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, 9)
                proc.join()
        for pipe in pipes:
            pipe.close()


def _caught_up(published: list[float], applies: list[dict[float, float]]) -> list[float]:
    """Per commit, the time until every proxy had applied it or a later commit."""
    per_proxy = []
    for applied in applies:
        keys = sorted(applied)
        # suffix minimum of applied_at over snapshots published at or after each key
        suffix = [0.0] * len(keys)
        low = float("inf")
        for i in range(len(keys) - 1, -1, -1):
            low = min(low, applied[keys[i]])
            suffix[i] = low
        per_proxy.append((keys, suffix))
    out = []
    for at in published:
        latest = 0.0
        for keys, suffix in per_proxy:
            i = bisect.bisect_left(keys, at)
            if i == len(keys):
                latest = float("inf")  # never caught up (did not reach the last commit)
                break
            latest = max(latest, suffix[i])
        if latest != float("inf"):
            out.append(max(0.0, latest - at))
    return out


async def commit_cost(store: Store, size: int, rounds: int) -> tuple[list[float], float, int]:
    """Time `rounds` commits that flip one replica of a `size`-replica service: wall
    times, the committer's mean CPU time per commit, the snapshot size."""
    name = f"size{size}"
    await register(store, name, [replica(i) for i in range(1, size + 1)])
    times = []
    snapshot = None
    cpu = time.process_time()
    for i in range(rounds):
        start = time.perf_counter()
        snapshot = await store.commit(name, replica_updates=[replica(1, ready=i % 2 == 1)])
        times.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu) / rounds
    assert snapshot is not None
    return times, cpu, len(encode_snapshot(snapshot))


# -- report ---------------------------------------------------------------------------------


def quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return at(0.5) * 1e3, at(0.99) * 1e3, ordered[-1] * 1e3


def convergence_rows(label: str, proxies: int, result: Propagation) -> list[str]:
    """Markdown rows: commit -> applied by the LAST of the proxies (exactly that commit;
    and that commit or a later one)."""
    failover = (f"{result.failover_seconds:.1f} s, {result.failed_commits} failed attempts"
                if result.failover_seconds else "-")
    rows = []
    for what, values in (("that commit", result.converged),
                         ("it or a later one", result.caught_up)):
        if not values:
            rows.append(f"| {label} | {what} | 0 | - | - | - | {result.superseded} "
                        f"| {failover} |")
            continue
        p50, p99, top = quantiles(values)
        rows.append(f"| {label} | {what} | {len(values)} | {p50:.2f} | {p99:.2f} | {top:.2f} "
                    f"| {result.superseded} | {failover} |")
    return rows


async def run(args: argparse.Namespace, url: str) -> None:
    async with Store.from_url(url, prefix=PREFIX) as store:
        result = await propagation(store, url, args.proxies, args.commits, args.interval)
        latencies, reached, commit_times = result.latencies, result.reached, result.commit_times
        sizes = []
        for size in COMMIT_SIZES:
            sizes.append((size, *await commit_cost(store, size, args.rounds)))
    with redis.Redis.from_url(url) as client:
        version = client.info("server")["redis_version"]

    print(
        f"redis-server {version} (embedded, no persistence), Python "
        f"{platform.python_version()} + uvloop, {os.cpu_count()} CPUs\n"
    )
    expected = args.proxies * args.commits
    p50, p99, top = quantiles(latencies)
    print(
        f"commit -> applied: {args.commits} commits (2 -> 3 -> 2 replicas), "
        f"{args.proxies} proxy processes, interval {args.interval * 1e3:g} ms"
    )
    print("| proxies | applied | p50 ms | p99 ms | max ms | generations reached |")
    print("|---:|---:|---:|---:|---:|---|")
    print(
        f"| {args.proxies} | {len(latencies)}/{expected} | {p50:.2f} | {p99:.2f} | {top:.2f} "
        f"| {min(reached)}..{max(reached)} |"
    )
    print(f"\nconvergence: commit -> applied by the LAST of {args.proxies} proxy processes "
          f"(failover run: {args.failover_interval * 1e3:g} ms between commits)")
    print("| redis | every proxy applied | commits | p50 ms | p99 ms | max ms | superseded "
          "| failover |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for line in convergence_rows("one redis-server", args.proxies, result):
        print(line)
    if args.failover:
        with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
            with SentinelGroup(Path(tmp), service="bench") as group:
                async with Store.from_url(group.url, prefix=PREFIX) as ha_store:
                    ha = await propagation(ha_store, group.url, args.proxies, args.commits,
                                           args.failover_interval,
                                           failover=lambda: _kill(group))
        for line in convergence_rows("sentinel, primary SIGKILLed once", args.proxies, ha):
            print(line)
    c50, c99, ctop = quantiles(commit_times)
    print(f"\n(those commits, 3 replicas: p50 {c50:.2f} ms, p99 {c99:.2f} ms, max {ctop:.2f} ms)")
    print(f"\none commit (WATCH, read, compute, MULTI/EXEC + PUBLISH), {args.rounds} commits each")
    print("| replicas | p50 ms | p99 ms | max ms | mean ms | committer CPU ms | snapshot bytes |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size, times, cpu, payload in sizes:
        s50, s99, stop = quantiles(times)
        mean = statistics.fmean(times) * 1e3
        print(
            f"| {size} | {s50:.2f} | {s99:.2f} | {stop:.2f} | {mean:.2f} | {cpu * 1e3:.2f} "
            f"| {payload} |"
        )


def _kill(group: SentinelGroup) -> float:
    start = time.monotonic()
    group.kill_primary()
    return time.monotonic() - start


def main() -> None:
    interrupt_on_sigterm()  # a bench stopped by `kill` stops what it started
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxies", type=int, default=8)
    parser.add_argument("--commits", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=0.0, help="pause between commits (s)")
    parser.add_argument("--rounds", type=int, default=200, help="commits per size when timing")
    parser.add_argument("--failover", action="store_true",
                        help="also measure convergence through a Sentinel failover")
    parser.add_argument("--failover-interval", type=float, default=0.01,
                        help="pause between commits in the failover run (s): commits must "
                        "outlast the failover, or all after it are superseded")
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        uvloop.run(run(args, server.url))


if __name__ == "__main__":
    main()
