"""A randomised model test of the controller against the real Redis.

Seeded random sequences of spec updates (count-only and full, rolling and
blue_green, some of them broken), probe failures, kills, external replicas and
clock jumps drive `Controller.step()` with a fake clock, a FAKE backend (no
processes: `FakeBackend`) and a FAKE prober (scripted readiness: `FakeProber`).
After every commit the store itself is checked (`CheckedStore`):

- every READY replica of an active version is in the snapshot, and only those;
- the snapshot is never empty while a READY replica of an active version exists;
- record, snapshot and the active versions agree; generations only grow;
- the controller never empties the ready set itself: when a commit takes the
  snapshot from non-empty to empty, every replica that was in it lost its
  readiness through a failure (never by being retired or drained).

At the end of each sequence the faults stop and the service must converge:
exactly the target number of READY replicas of the latest version, all in the
snapshot, nothing draining, and every fake process that was launched and is
no longer in the table terminated (no leaks).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import redis.asyncio as aioredis

from controlplane import ops
from controlplane.backends.external import ExternalBackend
from controlplane.reconcile import Controller, ControllerConfig
from controlplane.records import ReplicaRecord, ServiceRecord, compute_active_versions
from controlplane.rollout import plan_rollout, scale_down_order
from controlplane.servicespec import ServiceSpec, parse_spec
from controlplane.states import FAILED_REPLICA_STATUSES, ReplicaStatus, ServiceStatus, UpdateMode
from controlplane.store import Committed, MutationPlan, Store
from proxy.wire.snapshot import ReadySnapshot
from tests.support import builders
from tests.support.fakes import FakeBackend, FakeProber

R = TypeVar("R")

NAME = "svc"
DRAIN = 5.0
SEEDS = 24
ACTIONS = 40


class CheckedStore(Store):
    """A Store that checks the invariants after every commit (see the module docstring)."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        super().__init__(client, prefix=prefix)
        self.commits = 0
        self.last_generation = 0
        self.operator_removes = False  # an operator may empty the set by removing replicas

    async def commit_with(
        self, service: str, plan: MutationPlan[R], *, force: bool = False
    ) -> Committed[R]:
        before = await self.read_state(service)
        committed = await super().commit_with(service, plan, force=force)
        await self._check(service, before.snapshot if before else None, committed.snapshot)
        return committed

    async def commit(self, service: str, **kwargs: Any) -> ReadySnapshot:
        before = await self.read_state(service)
        snapshot = await super().commit(service, **kwargs)
        await self._check(service, before.snapshot if before else None, snapshot)
        return snapshot

    async def _check(
        self, service: str, before: ReadySnapshot | None, returned: ReadySnapshot
    ) -> None:
        self.commits += 1
        state = await self.read_state(service)
        assert state is not None and state.snapshot is not None
        record, table, snapshot = state.record, state.replicas, state.snapshot
        assert returned == snapshot
        assert state.generation >= self.last_generation
        self.last_generation = state.generation
        active = compute_active_versions(record, table.values())
        assert record.active_versions == active
        assert tuple(snapshot.active_versions) == active
        should_route = {
            r.id
            for r in table.values()
            if r.status is ReplicaStatus.READY and r.url is not None and r.version in active
        }
        assert {r.id for r in snapshot.replicas} == should_route
        if should_route:
            assert snapshot.replicas, "empty snapshot while a READY replica of an active version"
        for routed in snapshot.replicas:
            replica = table[routed.id]
            assert replica.status is ReplicaStatus.READY and replica.url == routed.url
        if (
            before is not None
            and before.replicas
            and not snapshot.replicas
            and record.status is not ServiceStatus.SHUTTING_DOWN
            and not self.operator_removes
        ):
            for routed in before.replicas:
                now = table.get(routed.id)
                lost = now is not None and (
                    now.status is ReplicaStatus.NOT_READY or now.status in FAILED_REPLICA_STATUSES
                )
                assert lost, f"the controller emptied the ready set: replica {routed.id} is {now}"


def spec(replicas: int, variant: int, broken: str | None = None) -> ServiceSpec:
    envs = {"VARIANT": str(variant)}
    if broken is not None:
        envs["BROKEN"] = broken
    return parse_spec(
        {
            "service": {
                "readiness_probe": {
                    "path": "/health",
                    "initial_delay_seconds": 10,
                    "consecutive_failure_threshold_timeout": 4,
                },
                "replicas": replicas,
            },
            "run": "serve",
            "envs": envs,
        }
    )


class Model:
    def __init__(self, store: CheckedStore, tmp_path: Path, rng: random.Random) -> None:
        self.store = store
        self.rng = rng
        self.now = 1_000_000.0
        self.backend = FakeBackend()
        self.prober = FakeProber()
        self.controller = Controller(
            store,
            ControllerConfig(redis_url="redis://unused", state_dir=tmp_path, drain_seconds=DRAIN),
            clock=lambda: self.now,
            backends={"local": self.backend, "external": ExternalBackend()},
            prober=self.prober,
        )
        self.variant = 0
        self.replicas = 2
        self.broken = False
        self.externals: list[str] = []
        self.log: list[str] = []

    async def table(self) -> dict[int, ReplicaRecord]:
        return await self.store.replicas(NAME)

    async def steps(self, n: int) -> None:
        for _ in range(n):
            await self.controller.step()

    async def act(self) -> None:
        rng = self.rng
        action = rng.choices(
            ["count", "spec", "broken", "flap", "heal", "kill", "external", "tick"],
            weights=[4, 3, 1, 2, 2, 1, 1, 4],
        )[0]
        table = await self.table()
        live = [r for r in table.values() if r.handle and r.status is not ReplicaStatus.FAILED]
        mode = rng.choice([None, UpdateMode.ROLLING, UpdateMode.BLUE_GREEN])
        match action:
            case "count":
                self.replicas = rng.randint(1, 4)
                version = await ops.update(store=self.store, name=NAME, spec=self.spec(), mode=mode)
                self.log.append(f"count-only update v{version} -> {self.replicas} ({mode})")
            case "spec" | "broken":
                self.replicas = rng.randint(1, 4)
                self.variant += 1
                broken = rng.choice(["crash", "never", "provision"]) if action == "broken" else None
                version = await ops.update(self.store, NAME, self.spec(broken), mode=mode)
                if broken == "never":
                    self.prober.never_ready_versions.add(version)
                self.broken = broken is not None
                self.log.append(f"update v{version} -> {self.replicas} {broken or ''} ({mode})")
            case "flap" if table:
                victim = rng.choice(sorted(table))
                self.prober.failing.add(victim)
                self.log.append(f"replica {victim} fails its probes")
            case "heal" if self.prober.failing:
                healed = rng.choice(sorted(self.prober.failing))
                self.prober.failing.discard(healed)
                self.log.append(f"replica {healed} healthy again")
            case "kill" if live:
                victim_record = rng.choice(live)
                self.backend.kill(victim_record.handle)
                self.log.append(f"replica {victim_record.id} killed")
            case "external":
                if self.externals and rng.random() < 0.5:
                    url = self.externals.pop()
                    self.store.operator_removes = True
                    try:
                        await ops.remove_replica(self.store, NAME, url)
                    finally:
                        self.store.operator_removes = False
                    self.log.append(f"external {url} removed")
                else:
                    url = f"http://127.0.0.2:{20000 + rng.randint(0, 10_000)}"
                    if url not in self.externals:
                        await ops.add_replica(self.store, NAME, url)
                        self.externals.append(url)
                        self.log.append(f"external {url} added")
            case _:
                jump = rng.choice([0.0, 0.5, 1.0, 3.0, DRAIN + 1, 12.0])
                self.now += jump
                self.log.append(f"clock +{jump}")
        await self.steps(rng.randint(1, 3))

    def spec(self, broken: str | None = None) -> ServiceSpec:
        return spec(self.replicas, self.variant, broken)

    async def converge(self) -> None:
        """Stop the faults; the service must settle on the target."""
        self.prober.failing.clear()
        (view,) = await ops.status(self.store, NAME)
        # A version is given up once a replica failed before ever being ready (a broken
        # version, or a healthy one whose replica failed its probes for the initial delay).
        if self.broken or view.launch_blocked is not None:
            self.variant += 1
            await ops.update(self.store, NAME, self.spec())
            self.log.append(f"final good update -> {self.replicas}")
        for _ in range(12):
            await self.steps(2)
            self.now += DRAIN + 1
        await self.steps(2)
        table = await self.table()
        record = await self.store.service(NAME)
        assert record is not None
        managed = [r for r in table.values() if r.backend == "local"]
        assert (
            sorted((r.version, r.status) for r in managed)
            == [(record.version, ReplicaStatus.READY)] * self.replicas
        ), managed
        externals = [r for r in table.values() if r.backend == "external"]
        assert sorted(r.url or "" for r in externals) == sorted(self.externals)
        assert all(r.status is ReplicaStatus.READY for r in externals)
        snapshot = await self.store.snapshot(NAME)
        assert snapshot is not None
        assert sorted(r.id for r in snapshot.replicas) == sorted(table)
        assert snapshot.active_versions == [record.version]
        assert record.status is ServiceStatus.READY
        # No leaked fake processes: every one launched and no longer recorded was terminated.
        recorded = {r.handle.get("pid") for r in table.values()}
        leaked = set(self.backend.launched) - recorded - self.backend.terminated
        assert not leaked, leaked
        assert all(pid not in self.backend.dead for pid in recorded if pid is not None)


@pytest.mark.parametrize("seed", range(SEEDS))
async def test_random_updates_faults_and_kills_keep_the_invariants(
    seed: int, redis_client: aioredis.Redis, redis_prefix: str, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    store = CheckedStore(redis_client, redis_prefix)
    model = Model(store, tmp_path, rng)
    await model.controller.start()
    try:
        await ops.up(store, NAME, model.spec())
        await model.steps(3)
        for _ in range(ACTIONS):
            await model.act()
        await model.converge()
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}; actions:\n  " + "\n  ".join(model.log)) from exc
    finally:
        await model.controller.aclose()
    assert store.commits > ACTIONS // 4


# -- deterministic scenarios with the same fakes -------------------------------------------


async def _started(redis_client: aioredis.Redis, prefix: str, tmp_path: Path) -> Model:
    store = CheckedStore(redis_client, prefix)
    model = Model(store, tmp_path, random.Random(0))
    await model.controller.start()
    await ops.up(store, NAME, model.spec())
    await model.steps(3)
    return model


def _ids(replicas: Iterable[ReplicaRecord]) -> list[int]:
    return sorted(r.id for r in replicas)


async def test_ten_count_only_updates_launch_only_the_third_replica(
    redis_client: aioredis.Redis, redis_prefix: str, tmp_path: Path
) -> None:
    model = await _started(redis_client, redis_prefix, tmp_path)
    try:
        store = model.store
        assert _ids((await model.table()).values()) == [1, 2]
        pids = {i: r.handle["pid"] for i, r in (await model.table()).items()}
        for n in [3, 2] * 5:
            model.replicas = n
            generation = await store.generation(NAME)
            version = await ops.update(store, NAME, model.spec())
            await model.controller.step()
            # One commit: relabel, active versions and (3 -> 2) the retirement together.
            assert await store.generation(NAME) == generation + 1
            snapshot = await store.snapshot(NAME)
            assert snapshot is not None and snapshot.active_versions == [version]
            assert [r.id for r in snapshot.replicas] == [1, 2]
            await model.steps(2)
            model.now += DRAIN + 1
            await model.steps(2)
            table = await model.table()
            assert len(table) == n and {i: table[i].handle["pid"] for i in (1, 2)} == pids
        kinds = [e.kind for e in await store.events(NAME, count=1000)]
        assert kinds.count("launch") == 7  # 2 + one third replica per 2 -> 3 update
        assert len(model.backend.launched) == 7
    finally:
        await model.controller.aclose()


async def test_scale_down_order_earliest_state_then_older_version_then_larger_id(
    redis_client: aioredis.Redis, redis_prefix: str, tmp_path: Path
) -> None:
    model = await _started(redis_client, redis_prefix, tmp_path)
    try:
        store = model.store
        model.replicas = 5
        await ops.update(store, NAME, model.spec())
        model.prober.failing.add(3)  # 3 never becomes ready: STARTING
        await model.steps(3)
        model.prober.failing.add(4)  # 4 ready, then NOT_READY
        await model.steps(1)
        table = await model.table()
        states = {i: r.status for i, r in table.items()}
        assert states == {1: ReplicaStatus.READY, 2: ReplicaStatus.READY,
                          3: ReplicaStatus.STARTING, 4: ReplicaStatus.NOT_READY,
                          5: ReplicaStatus.READY}  # fmt: skip
        expected_order = [3, 4, 5, 2]
        for n, retired in zip([4, 3, 2, 1], expected_order, strict=True):
            model.replicas = n
            await ops.update(store, NAME, model.spec())
            await model.controller.step()
            draining = {
                i for i, r in (await model.table()).items()
                if r.status is ReplicaStatus.SHUTTING_DOWN
            }  # fmt: skip
            assert retired in draining
        assert msgspec.structs.asdict((await model.table())[1])["status"] == "READY"
    finally:
        await model.controller.aclose()


async def test_down_drains_terminates_and_unregisters(
    redis_client: aioredis.Redis, redis_prefix: str, tmp_path: Path
) -> None:
    model = await _started(redis_client, redis_prefix, tmp_path)
    try:
        store = model.store
        await ops.down(store, NAME)
        await model.controller.step()
        snapshot = await store.snapshot(NAME)
        assert snapshot is not None and snapshot.replicas == ()  # out of the set at once
        assert model.backend.terminated == set()  # still draining
        model.now += DRAIN + 0.1
        await model.steps(3)
        assert await store.services() == []
        assert model.backend.terminated == set(model.backend.launched)
    finally:
        await model.controller.aclose()


class InterferingStore(CheckedStore):
    """Runs `interfere` once, just before the next commit_with: a write the plan missed."""

    interfere: Any = None

    async def commit_with(
        self, service: str, plan: MutationPlan[R], *, force: bool = False
    ) -> Committed[R]:
        if self.interfere is not None:
            interfere, self.interfere = self.interfere, None
            await interfere()
        return await super().commit_with(service, plan, force=force)


async def test_an_ops_write_between_read_and_commit_makes_the_controller_plan_again(
    redis_client: aioredis.Redis, redis_prefix: str, tmp_path: Path
) -> None:
    store = InterferingStore(redis_client, redis_prefix)
    model = Model(store, tmp_path, random.Random(0))
    model.store = store
    await model.controller.start()
    try:
        await ops.up(store, NAME, model.spec())
        await model.steps(3)
        model.replicas = 3
        await ops.update(store, NAME, model.spec())  # v2: one more replica
        model.replicas = 1

        async def count_only_update() -> None:
            await ops.update(store, NAME, model.spec())  # v3 lands mid-step

        store.interfere = count_only_update
        await model.controller.step()
        # The plan made for v2 (relabel to v2, launch a third) was dropped, not written:
        # the same step planned again for v3.
        table = await model.table()
        assert [(r.id, r.version, r.status) for r in table.values()] == [
            (1, 3, ReplicaStatus.READY), (2, 3, ReplicaStatus.SHUTTING_DOWN),
        ]  # fmt: skip
        assert model.backend.launched == {1001: 1, 1002: 2}
    finally:
        await model.controller.aclose()


# -- the rollout rules, pure -----------------------------------------------------------------


def _replica(i: int, version: int, status: ReplicaStatus) -> ReplicaRecord:
    return builders.replica(i, version=version, status=status)  # short, for the tables below


def test_rollout_rules() -> None:
    R, S, N = ReplicaStatus.READY, ReplicaStatus.STARTING, ReplicaStatus.NOT_READY
    table = [_replica(1, 1, R), _replica(2, 1, R), _replica(3, 2, R), _replica(4, 2, S)]
    rolling = ServiceRecord(name="s", version=2, min_replicas={2: 2})
    blue_green = msgspec.structs.replace(rolling, update_mode=UpdateMode.BLUE_GREEN)
    # rolling: one old replica leaves per new READY one; blue_green waits for min_replicas.
    plan = plan_rollout(rolling, table, 2, can_launch=True)
    assert plan.launch == 0 and [(r.id, why) for r, why in plan.retire] == [(2, "update")]
    assert plan_rollout(blue_green, table, 2, can_launch=True).retire == ()
    switched = [*table[:3], _replica(4, 2, R)]
    plan = plan_rollout(blue_green, switched, 2, can_launch=True)
    assert sorted(r.id for r, _ in plan.retire) == [1, 2]
    # Launch up to the target only while the version is not given up.
    assert plan_rollout(rolling, table[:3], 3, can_launch=True).launch == 2
    assert plan_rollout(rolling, table[:3], 3, can_launch=False).launch == 0
    order = scale_down_order(
        [_replica(1, 2, R), _replica(2, 1, R), _replica(3, 2, N), _replica(4, 2, S),
         _replica(5, 2, R)]
    )  # fmt: skip
    assert [r.id for r in order] == [4, 3, 2, 5, 1]
