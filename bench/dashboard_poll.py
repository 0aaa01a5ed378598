"""What `sluice dashboard` costs Redis: commands and time per poll, by fleet size and by
the number of open pages.

    python bench/dashboard_poll.py                       # 1, 10, 50 services x 4 replicas
    python bench/dashboard_poll.py --services 1,100 --replicas 8 --rounds 3 --streams 0,20

A private redis-server (EmbeddedRedis) holds N services with R READY replicas each, a
proxy heartbeat, in-flight entries, an hour of request counts (the rps hash proxies keep
with a one-hour TTL) and 100 events per service. For each cell one Poller steps
`--steps` times; the table shows Redis commands per step (INFO total_commands_processed,
minus the INFO itself), the median and max wall time of a step, and the size of the
documents it serves, with S event streams open on the dashboard's HTTP server (the
commands per step must not move with S). Each cell is repeated `--rounds` times; the
spread is shown. Times are noisy on a shared machine: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/dashboard_poll.py` without installing
    sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import msgspec  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from aiohttp import web  # noqa: E402

from controlplane.dashboard import DashboardConfig  # noqa: E402
from controlplane.dashboard.poller import Poller  # noqa: E402
from controlplane.dashboard.server import make_app  # noqa: E402
from controlplane.records import ReplicaRecord, ServiceRecord, ServiceStatus  # noqa: E402
from controlplane.redisserver import EmbeddedRedis  # noqa: E402
from controlplane.servicespec import parse_spec  # noqa: E402
from controlplane.states import ReplicaStatus  # noqa: E402
from controlplane.store import Store  # noqa: E402
from proxy.wire.telemetry import InflightEntry, ProxyHeartbeat  # noqa: E402
from tests.support.pids import interrupt_on_sigterm  # noqa: E402
from tests.support.ports import HOST, free_port  # noqa: E402


async def populate(store: Store, client: aioredis.Redis, prefix: str, services: int,
                   replicas: int) -> None:  # fmt: skip
    spec = parse_spec({"service": {"readiness_probe": "/health", "replicas": replicas},
                       "run": "true"}).to_json()  # fmt: skip
    now = time.time()
    for s in range(services):
        name = f"svc-{s}"
        await store.register_service(ServiceRecord(name=name, status=ServiceStatus.READY), spec)
        records = [ReplicaRecord(id=i, status=ReplicaStatus.READY, url=f"http://10.0.{s}.{i}:80",
                                 launched_at=now) for i in range(1, replicas + 1)]  # fmt: skip
        await store.commit(name, replica_updates=records)
        keys = store.keys
        beat = ProxyHeartbeat(generation=2, applied_at=now, seen_at=now + 3600, connected=True)
        await client.hset(keys.proxies(name), "bench:1", msgspec.json.encode(beat))
        entry = InflightEntry(at=now + 3600, total=replicas,
                              replicas={r.url or "": 1 for r in records})  # fmt: skip
        await client.hset(keys.inflight(name), "bench:1", msgspec.json.encode(entry))
        await client.hset(keys.rps(name), mapping={str(int(now) - i): 5 for i in range(3600)})
        for i in range(100):
            await store.append_event(name, "launch", {"replica": 1 + i % replicas})


async def cell(url: str, services: int, replicas: int, streams: int, steps: int,
               prefix: str) -> tuple[float, list[float], int]:  # fmt: skip
    """(commands per step, step times in s, bytes of one step's documents)."""
    client = aioredis.from_url(url)
    store = Store(client, prefix=prefix)
    await populate(store, client, prefix, services, replicas)
    poller = Poller(store)
    await poller.step()
    config = DashboardConfig(port=free_port())
    runner = web.AppRunner(make_app(poller, config), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, HOST, config.port).start()
    http = aiohttp.ClientSession()
    opened = [await http.get(f"http://{HOST}:{config.port}/api/stream?service=svc-0")
              for _ in range(streams)]  # fmt: skip
    try:
        times = []
        before = int((await client.info("stats"))["total_commands_processed"])
        for _ in range(steps):
            started = time.perf_counter()
            await poller.step()
            times.append(time.perf_counter() - started)
        after = int((await client.info("stats"))["total_commands_processed"])
        size = len(poller.fleet) + sum(len(b) for b in poller.latest.values())
        return (after - before - 1) / steps, times, size
    finally:
        for resp in opened:
            resp.close()
        await http.close()
        await runner.cleanup()
        await client.flushdb()
        await client.aclose()


def spread(values: list[float]) -> str:
    mid = statistics.median(values)
    return f"{mid:.1f} ({min(values):.1f}-{max(values):.1f})"


async def run(args: argparse.Namespace, url: str) -> None:
    print(f"{'services':>8} {'replicas':>8} {'streams':>7} {'cmds/step':>10} "
          f"{'step ms median (min-max of rounds)':>36} {'step ms max':>11} {'docs KB':>8}")
    for services in args.services:
        for streams in args.streams:
            cmds, medians, maxes, sizes = [], [], [], []
            for r in range(args.rounds):
                c, times, size = await cell(url, services, args.replicas, streams, args.steps,
                                            prefix=f"bench{r}")  # fmt: skip
                cmds.append(c)
                medians.append(1000 * statistics.median(times))
                maxes.append(1000 * max(times))
                sizes.append(size / 1024)
            print(f"{services:>8} {args.replicas:>8} {streams:>7} {spread(cmds):>10} "
                  f"{spread(medians):>36} {max(maxes):>11.1f} {statistics.median(sizes):>8.0f}")


def main() -> None:
    interrupt_on_sigterm()  # a bench stopped by `kill` stops what it started
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=ints, default=[1, 10, 50])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--streams", type=ints, default=[0, 10])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        asyncio.run(run(args, server.url))


if __name__ == "__main__":
    main()
