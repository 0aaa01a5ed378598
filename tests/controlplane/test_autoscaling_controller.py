"""The autoscaler wired into the controller, driven by `step()` with an injected clock
against a real redis-server: synthetic per-second counts and in-flight entries are
written to the keys the proxies write, and a FAKE backend and prober stand in for
replica processes (launches succeed at once, probes answer from a flag).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from controlplane import ops
from controlplane.backends.external import ExternalBackend
from controlplane.display import status_text
from controlplane.reconcile import Controller, ControllerConfig
from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.rollout import plan_rollout
from controlplane.servicespec import ServiceSpec, parse_spec
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store, StoreUnavailable
from tests.support.cli import sluice as run_cli
from tests.support.cli import store_call
from tests.support.fakes import FakeBackend, FakeProber

NAME = "svc"
T0 = 1_000_000.0


def spec(policy: dict[str, Any], *, use_spot: bool = False) -> ServiceSpec:
    doc: dict[str, Any] = {
        "service": {
            "readiness_probe": {"path": "/health", "initial_delay_seconds": 600},
            "replica_policy": policy,
        },
        "run": "serve",
    }
    if use_spot:
        doc["resources"] = {"use_spot": True}
    return parse_spec(doc)


class Harness:
    """A controller on a fake clock; `tick()` moves the clock and steps until settled."""

    def __init__(self, store: Store, client: aioredis.Redis, tmp_path: Path) -> None:
        self.store = store
        self.client = client
        self.now = T0
        self.backend = FakeBackend("fake")
        self.prober = FakeProber()
        config = ControllerConfig(
            redis_url="redis://unused",
            prefix=store.keys.prefix,
            state_dir=tmp_path,
            drain_seconds=0.0,
            backend="fake",
            autoscaler_interval=1.0,
            autoscaler_zero_interval=1.0,
            qps_window_seconds=1,  # each second's count is the signal: noise is visible
        )
        self.controller = Controller(
            store,
            config,
            clock=lambda: self.now,
            backends={"fake": self.backend, "external": ExternalBackend()},
            prober=self.prober,
        )

    async def live(self) -> list[ReplicaRecord]:
        table = await self.store.replicas(NAME)
        live = {ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.NOT_READY}
        return sorted((r for r in table.values() if r.status in live), key=lambda r: r.id)

    async def settle(self, within: float = 5.0) -> None:
        """Step until a step changes nothing and no launch or termination is pending."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        previous: dict[int, ReplicaRecord] | None = None
        while True:
            await self.controller.step()
            table = await self.store.replicas(NAME)
            transient = any(
                r.status in (ReplicaStatus.PENDING, ReplicaStatus.PROVISIONING)
                or r.status is ReplicaStatus.SHUTTING_DOWN
                or r.status is ReplicaStatus.PREEMPTED
                for r in table.values()
            )
            if table == previous and not transient:
                return
            previous = table
            assert loop.time() < deadline, f"the controller did not settle: {table}"
            await asyncio.sleep(0.002)  # let the launch / terminate tasks run

    async def tick(self, seconds: float = 1.0) -> None:
        self.now += seconds
        await self.settle()

    async def set_rps(self, second: float, count: int) -> None:
        await self.client.hset(self.store.keys.rps(NAME), str(int(second)), count)

    async def decision(self) -> Any:
        status = await self.store.telemetry.read_autoscaler(NAME)
        assert status is not None
        return status


@pytest.fixture
async def harness(
    store: Store, redis_client: aioredis.Redis, tmp_path: Path
) -> AsyncIterator[Harness]:
    h = Harness(store, redis_client, tmp_path)
    await h.controller.start()
    try:
        yield h
    finally:
        await h.controller.aclose()


QPS_POLICY = {
    "min_replicas": 1,
    "max_replicas": 4,
    "target_qps_per_replica": 2,
    "upscale_delay_seconds": 10,
    "downscale_delay_seconds": 20,
}


async def test_qps_scales_up_after_the_delay_despite_a_dip_and_down_after_the_delay(
    harness: Harness,
) -> None:
    h = harness
    await ops.up(h.store, NAME, spec(QPS_POLICY))
    await h.settle()
    assert len(await h.live()) == 1

    # 6 requests every second (QPS 6 -> 3 replicas), but second 5 has a dip to 0.
    for second in range(int(T0) - 2, int(T0) + 40):
        await h.set_rps(second, 0 if second == int(T0) + 5 else 6)
    counts = []
    for _ in range(12):
        await h.tick()
        counts.append(len(await h.live()))
    # The window at t=10 s still holds the t=0 sample (taken before the traffic) and
    # the dip: one low sample is discarded, not two. At t=11 s only the dip is left and
    # it is discarded: the dip neither reset nor delayed the decision (Sky Serve's
    # counters would restart the whole delay at it).
    assert counts[:10] == [1] * 10, counts
    assert counts[10:] == [3, 3], counts
    decision = await h.decision()
    assert decision.target == 3 and decision.qps == pytest.approx(6.0)
    assert decision.window_min == 3

    # Traffic ends: the target drops after the 20 s downscale delay.
    await h.client.delete(h.store.keys.rps(NAME))
    down_at = h.now
    while len(await h.live()) == 3:
        await h.tick()
        assert h.now - down_at <= 22, "no downscale"
    # Not before the delay, less the tenth of the window's samples taken as outliers.
    assert h.now - down_at >= 20 * 0.9
    assert len(await h.live()) == 1
    decision = await h.decision()
    assert (decision.reason, decision.window_max, decision.target) == ("downscale", 1, 1)


async def test_an_update_resets_the_target_to_the_computed_one(harness: Harness) -> None:
    h = harness
    await ops.up(h.store, NAME, spec(QPS_POLICY))
    await h.settle()
    for second in range(int(T0) - 2, int(T0) + 10):
        await h.set_rps(second, 8)  # QPS 8 -> 4 replicas
    await ops.update(h.store, NAME, spec({**QPS_POLICY, "upscale_delay_seconds": 300}))
    await h.tick()
    assert len(await h.live()) == 4  # adopted at once, no 300 s wait
    assert (await h.decision()).reason in ("reset", "hold")


async def test_demand_scales_from_zero_at_once_and_idle_goes_back_to_zero(
    harness: Harness,
) -> None:
    h = harness
    policy = {**QPS_POLICY, "min_replicas": 0, "downscale_delay_seconds": 5}
    await ops.up(h.store, NAME, spec(policy))
    await h.settle()
    assert await h.live() == []
    assert (await h.store.service(NAME)).status is ServiceStatus.NO_REPLICA  # type: ignore[union-attr]

    h.controller.demand(NAME)  # what a proxy's "demand" nudge does
    await h.settle()  # same instant: no decision interval waited
    assert [r.status for r in await h.live()] == [ReplicaStatus.READY]
    assert (await h.decision()).reason == "demand"

    for _ in range(4):
        await h.tick()
        assert len(await h.live()) == 1
    for _ in range(3):
        await h.tick()
    assert await h.live() == []
    assert (await h.decision()).target == 0


async def test_concurrency_target_sums_fresh_inflight_entries(harness: Harness) -> None:
    h = harness
    policy = {
        "min_replicas": 1,
        "max_replicas": 5,
        "target_ongoing_requests": 2,
        "upscale_delay_seconds": 3,
        "downscale_delay_seconds": 30,
    }
    await ops.up(h.store, NAME, spec(policy))
    await h.settle()
    key = h.store.keys.inflight(NAME)
    for _ in range(4):
        await h.client.hset(key, mapping={
            "proxy-a": json.dumps({"at": h.now, "total": 3, "replicas": {}}),
            "proxy-b": json.dumps({"at": h.now, "total": 4, "replicas": {}}),
            "gone": json.dumps({"at": h.now - 60, "total": 100, "replicas": {}}),
        })  # fmt: skip
        await h.tick()
    decision = await h.decision()
    assert decision.inflight == 7 and decision.raw == 4  # ceil(7 / 2); stale entry ignored
    assert len(await h.live()) == 4


async def test_spot_fallback_arithmetic_and_preemption_through_the_controller(
    harness: Harness,
) -> None:
    h = harness
    policy = {
        "min_replicas": 3,
        "base_ondemand_fallback_replicas": 1,
        "dynamic_ondemand_fallback": True,
    }
    h.prober.hold_spot = True
    await ops.up(h.store, NAME, spec(policy, use_spot=True))
    await h.settle()

    def kinds(replicas: list[ReplicaRecord]) -> tuple[int, int, int]:
        spot = [r for r in replicas if r.spot]
        ready_spot = sum(1 for r in spot if r.status is ReplicaStatus.READY)
        return len(spot), ready_spot, len(replicas) - len(spot)

    # 3 wanted: 1 base on-demand + 2 spot; no spot READY -> 2 more on-demand.
    assert kinds(await h.live()) == (2, 0, 3)
    h.prober.hold_spot = False
    await h.tick()
    assert kinds(await h.live()) == (2, 2, 1)  # spot back: the dynamic on-demand ones left

    h.prober.hold_spot = True  # the replacement will take a while
    victim = next(r for r in await h.live() if r.spot)
    await ops.preempt_replica(h.store, NAME, victim.id)
    snapshot = await h.store.snapshot(NAME)
    assert snapshot is not None and victim.id not in {r.id for r in snapshot.replicas}
    await h.tick()
    assert victim.id in h.backend.terminated_replicas()
    assert victim.id not in await h.store.replicas(NAME)
    assert kinds(await h.live()) == (2, 1, 2)  # a new spot one starting, one on-demand more

    h.prober.hold_spot = False
    await h.tick()
    assert kinds(await h.live()) == (2, 2, 1)
    kinds_seen = [e.kind for e in await h.store.events(NAME, count=1000)]
    assert "preempt" in kinds_seen


def _ready(replica_id: int, target_qps: float) -> ReplicaRecord:
    return ReplicaRecord(
        id=replica_id, status=ReplicaStatus.READY, backend="fake", target_qps=target_qps
    )


def test_instance_aware_scale_down_removes_the_lowest_capacity_first() -> None:
    record = ServiceRecord(name=NAME)
    managed = [_ready(1, 1.0), _ready(2, 8.0), _ready(3, 2.0), _ready(4, 8.0)]
    rollout = plan_rollout(record, managed, 2, can_launch=True, by_capacity=True)
    assert sorted(r.id for r, _ in rollout.retire) == [1, 3]
    plain = plan_rollout(record, managed, 2, can_launch=True)
    assert sorted(r.id for r, _ in plain.retire) == [3, 4]  # larger id first


async def test_status_describes_the_policy_the_target_and_the_window(
    harness: Harness,
) -> None:
    h = harness
    await ops.up(h.store, NAME, spec(QPS_POLICY))
    await h.settle()
    [view] = await ops.status(h.store, NAME)
    assert view.autoscaling == "Autoscaling from 1 to 4 replicas (target QPS per replica: 2.0)"
    assert view.target == 1 and view.autoscaler is not None
    assert view.autoscaler.reason == "hold" and view.autoscaler.qps == 0.0
    text = status_text([view], h.now)
    assert "svc: Autoscaling from 1 to 4 replicas (target QPS per replica: 2.0); target 1" in text
    encoded = json.loads(msgspec.json.encode(view))
    assert {"qps", "raw", "window_min", "window_max", "reason"} <= set(encoded["autoscaler"])


def test_cli_status_json_and_replica_preempt(redis_url: str, redis_prefix: str) -> None:
    def sluice(*args: str) -> Any:
        return run_cli(*args, "--redis", redis_url, "--prefix", redis_prefix)

    def setup(fn: Callable[[Store], Awaitable[Any]]) -> Any:
        return store_call(redis_url, redis_prefix, fn)

    setup(lambda s: ops.up(s, NAME, spec(QPS_POLICY)))
    replica = ReplicaRecord(id=1, status=ReplicaStatus.READY, url="http://127.0.0.1:1")
    setup(lambda s: s.commit(NAME, replica_updates=[replica]))

    result = sluice("status", NAME, "--json")
    assert result.exit_code == 0, result.output
    [view] = json.loads(result.output)
    assert view["autoscaling"].startswith("Autoscaling from 1 to 4 replicas")
    assert view["target"] == 1

    result = sluice("replica", "preempt", NAME, "1")
    assert result.exit_code == 0, result.output
    assert "preempted" in result.output
    table = setup(lambda s: s.replicas(NAME))
    assert table[1].status is ReplicaStatus.PREEMPTED
    result = sluice("replica", "preempt", NAME, "1")
    assert result.exit_code != 0 and "no live replica 1" in result.output


async def test_a_decision_is_written_once_its_plan_is_committed(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Planning does no I/O: the first step decides (a new autoscaler decides at once)
    # and plans a launch, but what it decided reaches Redis only with the commit. A
    # failed commit writes nothing; the next step that commits writes the decision.
    h = harness
    await ops.up(h.store, NAME, spec(QPS_POLICY))
    committed = h.store.commit_with

    async def refused(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("injected: the commit did not happen")

    monkeypatch.setattr(h.store, "commit_with", refused)
    with pytest.raises(StoreUnavailable, match="injected"):
        await h.controller.step()
    assert await h.store.telemetry.read_autoscaler(NAME) is None
    assert await h.store.replicas(NAME) == {}

    monkeypatch.setattr(h.store, "commit_with", committed)
    await h.settle()  # the clock has not moved: no new decision falls due
    decision = await h.decision()
    assert (decision.at, decision.target, decision.reason) == (T0, 1, "hold")
    assert len(await h.live()) == 1
