"""The end-to-end regression for Sky Serve's count-only update gap.

Sky Serve, measured on a real cluster over 10 count-only updates at 20 req/s:
1,045 x 503, 160 requests hung to the client timeout, every replica replaced
on every update (27 launches where 7 were needed). The cause: the relabel of
reused replicas and the new active versions are written apart, and the load
balancer's pull in between sees nobody to route to.

Here: replicas whose readiness path takes 2 s to answer (so a fresh replica
needs a while to become READY, and a re-probe of a reused one would hurt), a
real sluice-proxy following the service through Redis, 20 req/s of steady load,
10 count-only updates alternating 3 and 2 replicas. Required: 0 non-2xx, 0
requests slower than 2 s, replicas 1 and 2 the same processes and serving in
every second of the run; only the third replica comes and goes (7 launches).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from controlplane import ops
from controlplane.reconcile import Controller
from controlplane.servicespec import ServiceSpec, parse_spec
from controlplane.store import Store
from tests.support.builders import ready_view
from tests.support.fakes import controller_config
from tests.support.poll import until
from tests.support.processes import REPO, ProxyFactory
from tests.support.traffic import Traffic

HEALTH_DELAY = 2.0
UPDATES = 10
RATE = 20.0


def spec(replicas: int) -> ServiceSpec:
    return parse_spec(
        {
            "service": {
                "readiness_probe": {
                    "path": "/health",
                    "timeout_seconds": 5,
                    "endpoint_probe_interval_seconds": 1,
                    "initial_delay_seconds": 60,
                },
                "replicas": replicas,
            },
            "workdir": str(REPO),
            "run": f"exec {sys.executable} -m tests.support.slow_health_replica --port $PORT"
            f" --id $SLUICE_REPLICA_ID --health-delay {HEALTH_DELAY}",
        }
    )


async def settled(store: Store, n: int) -> ops.ServiceView:
    """n replicas, all READY, nothing draining."""
    return await ready_view(store, "llm", n)


async def served_by(traffic: Traffic, replica: str, within: float = 10.0) -> None:
    """Until `replica` answered 3 requests."""
    await until(lambda: sum(o.replica == replica for o in traffic.outcomes) >= 3,
                timeout=within, what=f"replica {replica} to serve 3 requests")  # fmt: skip


@pytest.mark.slow
async def test_ten_count_only_updates_lose_nothing_and_replace_nothing(
    store: Store,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
    proxy_factory: ProxyFactory,
) -> None:
    config = controller_config(redis_url, redis_prefix, tmp_path, lease_ttl=10.0,
                               reconcile_interval=5.0)  # fmt: skip
    controller = Controller(store, config)
    await controller.start()
    runner = asyncio.create_task(controller.run())
    try:
        await ops.up(store, "llm", spec(2))
        await settled(store, 2)
        pids = {i: r.handle["pid"] for i, r in (await store.replicas("llm")).items()}
        assert sorted(pids) == [1, 2]
        proxy = await proxy_factory.astart(
            "--redis", redis_url, "--service", "llm", "--redis-prefix", redis_prefix,
            "--shutdown-grace", "1", wait="ready",
        )  # fmt: skip

        started = time.monotonic()
        async with Traffic(proxy.url, rate=RATE, path="/generate", timeout=30) as traffic:
            for n in [3, 2] * (UPDATES // 2):
                await ops.update(store, "llm", spec(n))
                view = await settled(store, n)
                table = await store.replicas("llm")
                assert {i: table[i].handle["pid"] for i in (1, 2)} == pids
                if n == 3:  # the third one takes its share before it goes again
                    third = str(max(r.id for r in view.replicas))
                    await served_by(traffic, third)
        elapsed = time.monotonic() - started

        events = await store.events("llm", count=10_000)
        launches = [e for e in events if e.kind == "launch"]
        terminated = [e for e in events if e.kind == "terminate"]
        outcomes = traffic.outcomes
        failures = traffic.failures()
        slow = traffic.slower_than(2.0)
        by_replica = Counter(o.replica for o in outcomes)
        per_second: dict[int, set[str | None]] = defaultdict(set)
        for o in outcomes:
            per_second[int(o.started - outcomes[0].started)].add(o.replica)
        whole_seconds = range(int(elapsed) - 1)  # the last second may be partial
        gaps = [s for s in whole_seconds if not {"1", "2"} <= per_second[s]]
        print(
            f"\ncount-only regression: {UPDATES} updates over {elapsed:.1f}s at {RATE:g} req/s: "
            f"{len(outcomes)} requests, {len(failures)} non-2xx, {len(slow)} slower than 2 s, "
            f"max latency {max(o.latency for o in outcomes) * 1000:.0f} ms, "
            f"{len(launches)} launches (needed 7), {len(terminated)} terminations, "
            f"replicas 1 and 2 replaced: 0 (same pids), seconds without both 1 and 2: "
            f"{len(gaps)}; served by replica: {dict(sorted(by_replica.items()))}"
        )
        assert failures == [], failures[:5]
        assert slow == [], slow[:5]
        assert len(outcomes) >= RATE * elapsed * 0.9
        assert len(launches) == 2 + UPDATES // 2
        assert [e.fields["replica"] for e in launches] == [str(i) for i in range(1, 8)]
        assert len(terminated) == UPDATES // 2
        assert gaps == [], f"replicas 1 and 2 did not both serve in seconds {gaps}"
        assert all(by_replica[str(i)] > 0 for i in range(1, 8))
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        await controller.aclose()
