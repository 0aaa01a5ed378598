"""Autoscaling end to end: a real controller (run(), real clock), real local replica
processes, a real redis-server and a real sluice-proxy feeding the request counts
and the demand nudges. Delays and the decision interval are shortened to seconds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controlplane import ops
from controlplane.reconcile import ControllerConfig
from controlplane.servicespec import ServiceSpec, parse_spec
from controlplane.store import Store
from tests.support.builders import RUN
from tests.support.controllers import proxy_for
from tests.support.fakes import StartController, controller_config
from tests.support.processes import REPO, ProxyFactory
from tests.support.traffic import Traffic

pytestmark = pytest.mark.slow

PROBE = {
    "path": "/health",
    "endpoint_probe_interval_seconds": 0.2,
    "timeout_seconds": 2,
    "initial_delay_seconds": 20,
}
LIVE = {"PROVISIONING", "PENDING", "STARTING", "READY", "NOT_READY"}

def spec(policy: dict[str, Any], *, use_spot: bool = False) -> ServiceSpec:
    doc: dict[str, Any] = {
        "service": {"readiness_probe": PROBE, "replica_policy": policy},
        "workdir": str(REPO),
        "run": RUN,
    }
    if use_spot:
        doc["resources"] = {"use_spot": True}
    return parse_spec(doc)


@pytest.fixture
def config(redis_url: str, redis_prefix: str, tmp_path: Path) -> ControllerConfig:
    # What happens below is nudges and deadlines (a slow periodic reconcile).
    return controller_config(redis_url, redis_prefix, tmp_path, lease_ttl=10.0,
                             drain_seconds=0.5, autoscaler_interval=0.5,
                             autoscaler_zero_interval=0.5, qps_window_seconds=2)  # fmt: skip


def live(view: ops.ServiceView) -> list[ops.ReplicaStatusView]:
    return [r for r in view.replicas if r.status in LIVE]


async def test_traffic_raises_the_replica_count_and_its_end_lowers_it(
    store: Store,
    redis_url: str,
    redis_prefix: str,
    start_controller: StartController,
    proxy_factory: ProxyFactory,
) -> None:
    await start_controller()
    policy = {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_qps_per_replica": 4,
        "upscale_delay_seconds": 2,
        "downscale_delay_seconds": 3,
    }
    await ops.up(store, "svc", spec(policy))
    await ops.wait_for(store, "svc", lambda v: v.ready == 1, timeout=20)
    url = await proxy_for(proxy_factory, redis_url, redis_prefix, "svc", wait="health")

    async with Traffic(url, rate=20) as traffic:  # QPS 20 / 4 -> 5, clipped to 3
        up = await ops.wait_for(store, "svc", lambda v: v.ready == 3, timeout=30)
    assert up.autoscaler is not None and up.autoscaler.reason in ("upscale", "hold")
    assert up.target == 3
    assert traffic.failures() == [], traffic.failures()[:5]

    down = await ops.wait_for(
        store, "svc", lambda v: len(live(v)) == 1 and v.ready == 1, timeout=30
    )
    assert down.target == 1
    kinds = [e.kind for e in await store.events("svc", count=1000)]
    assert kinds.count("launch") == 3 and kinds.count("drain") >= 2


async def test_scale_from_zero_holds_the_first_request_and_answers_200(
    store: Store,
    redis_url: str,
    redis_prefix: str,
    start_controller: StartController,
    proxy_factory: ProxyFactory,
) -> None:
    # Periodic decisions while at zero are 30 s apart: only the proxy's demand nudge
    # can explain a launch within the test.
    await start_controller(autoscaler_zero_interval=30.0)
    policy = {
        "min_replicas": 0,
        "max_replicas": 2,
        "target_qps_per_replica": 5,
        "upscale_delay_seconds": 2,
        "downscale_delay_seconds": 60,
    }
    await ops.up(store, "svc", spec(policy))
    view = await ops.wait_for(store, "svc", lambda v: v.status == "NO_REPLICA", timeout=10)
    assert view.replicas == [] and view.target == 0
    url = await proxy_for(proxy_factory, redis_url, redis_prefix, "svc", "--empty-wait", "30",
                    wait="health")

    started = time.monotonic()
    async with aiohttp.ClientSession() as session, session.get(f"{url}/fast") as resp:
        body = await resp.read()
        status = resp.status
    held = time.monotonic() - started
    print(f"\nscale from zero: first request held {held:.2f}s, answered {status}")
    assert status == 200, body[:200]
    [replica] = (await ops.status(store, "svc"))[0].replicas
    assert replica.status == "READY"
    decision = await store.telemetry.read_autoscaler("svc")
    assert decision is not None and decision.target == 1
    assert held < 20


async def test_preemption_under_dynamic_fallback_brings_on_demand_then_retires_it(
    store: Store, start_controller: StartController
) -> None:
    await start_controller()
    policy = {"min_replicas": 1, "dynamic_ondemand_fallback": True}
    await ops.up(store, "svc", spec(policy, use_spot=True))

    def only_ready_spot(view: ops.ServiceView) -> bool:
        replicas = live(view)
        return len(replicas) == 1 and replicas[0].spot and replicas[0].status == "READY"

    first = await ops.wait_for(store, "svc", only_ready_spot, timeout=30)
    victim = live(first)[0].id

    seen_on_demand: set[int] = set()

    def on_demand_serving(view: ops.ServiceView) -> bool:
        seen_on_demand.update(r.id for r in live(view) if not r.spot)
        return any(not r.spot and r.status == "READY" for r in live(view)) or only_ready_spot(
            view
        )

    await ops.preempt_replica(store, "svc", victim)
    await ops.wait_for(store, "svc", on_demand_serving, timeout=30)
    final = await ops.wait_for(
        store,
        "svc",
        lambda v: on_demand_serving(v) and only_ready_spot(v) and victim not in
        {r.id for r in v.replicas},
        timeout=30,
    )
    assert seen_on_demand, "no on-demand replica was launched for the preempted spot one"
    assert live(final)[0].id != victim
    kinds = [e.kind for e in await store.events("svc", count=1000)]
    assert "preempt" in kinds
