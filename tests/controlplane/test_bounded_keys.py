"""What proxies and nudges write stays bounded and never stops the controller: the rps
hash of every service is trimmed, a malformed rps field is skipped and logged, and the
pending-demand set keeps only names of registered services, at most a fixed number.
A real controller (stepped in process) on a real redis-server."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from controlplane import ops
from controlplane.autoscaler import QPS_WINDOW_SECONDS
from controlplane.reconcile import Controller, ControllerConfig
from controlplane.reconcile.scalestate import MAX_PENDING_DEMAND
from controlplane.servicespec import ServiceSpec, parse_spec
from controlplane.store import Store


def spec(policy: dict[str, Any]) -> ServiceSpec:
    # No `run`: the controller launches nothing; it still reconciles the service.
    return parse_spec({"service": {"readiness_probe": "/health", "replica_policy": policy}})


FIXED = {"min_replicas": 1}
ON_QPS = {"min_replicas": 1, "max_replicas": 3, "target_qps_per_replica": 1}


@pytest.fixture
async def controller(
    store: Store, redis_url: str, redis_prefix: str, tmp_path: Path
) -> AsyncIterator[Controller]:
    config = ControllerConfig(
        redis_url=redis_url, prefix=redis_prefix, state_dir=tmp_path / "state",
        reconcile_interval=30.0, terminate_on_exit=True,
    )  # fmt: skip
    async with Controller(store, config) as controller:
        yield controller


async def test_rps_is_trimmed_for_a_service_that_does_not_autoscale_on_qps(
    controller: Controller, store: Store, redis_client: aioredis.Redis
) -> None:
    await ops.up(store, "svc", spec(FIXED))
    now = int(time.time())
    old = {str(now - 10_000 + i): 1 for i in range(500)}  # what hours of proxies leave
    recent = {str(now - 2): 7}
    await redis_client.hset(store.keys.rps("svc"), mapping={**old, **recent})
    await controller.step()
    left = await redis_client.hgetall(store.keys.rps("svc"))
    assert left == {k.encode(): str(v).encode() for k, v in recent.items()}


async def test_a_malformed_rps_field_is_skipped_and_logged(
    controller: Controller,
    store: Store,
    redis_client: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await ops.up(store, "qps", spec(ON_QPS))
    await ops.up(store, "fixed", spec(FIXED))
    now = int(time.time())
    for name in ("qps", "fixed"):
        await redis_client.hset(
            store.keys.rps(name),
            mapping={"not-a-second": 1, str(now - 3): "many", str(now - 2): 30},
        )
    with caplog.at_level(logging.WARNING):
        await controller.step()  # does not raise
    assert "invalid rps value(s) written to Redis" in caplog.text
    # The autoscaler decided on what parsed (30 requests in the window).
    status = await store.telemetry.read_autoscaler("qps")
    assert status is not None and status.qps == pytest.approx(30 / QPS_WINDOW_SECONDS)
    # A field that is not a second with a count is deleted by the trim (nothing would
    # ever age it out; a proxy's HINCRBY on it would fail).
    for name in ("qps", "fixed"):
        fields = await redis_client.hkeys(store.keys.rps(name))
        assert b"not-a-second" not in fields and str(now - 3).encode() not in fields
    # Reconciliation went on: both services got a status from the controller.
    for name in ("qps", "fixed"):
        [view] = await ops.status(store, name)
        assert view.status != "CONTROLLER_INIT"


async def test_pending_demand_is_bounded_and_keeps_only_registered_services(
    controller: Controller, store: Store
) -> None:
    await ops.up(store, "svc", spec(ON_QPS))
    for i in range(MAX_PENDING_DEMAND * 2):  # what anyone who can PUBLISH can send
        controller.demand(f"ghost-{i}")
    assert len(controller.autoscalers.pending_demand) <= MAX_PENDING_DEMAND
    await controller.step()
    assert controller.autoscalers.pending_demand <= {"svc"}
    controller.demand("ghost")
    await controller.step()
    assert controller.autoscalers.pending_demand == frozenset()
