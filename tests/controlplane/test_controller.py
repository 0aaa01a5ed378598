"""The controller with real local replicas, a real redis-server and, where traffic
matters, a real sluice-proxy following the service through Redis.

Controllers here reconcile on their own only every 30 s: everything they do in
these tests happens because a nudge, a probe result, a finished launch or
termination, or a drain deadline woke them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from controlplane import ops
from controlplane.backends.base import Launched, LaunchFailed
from controlplane.backends.external import ExternalBackend
from controlplane.backends.local import LocalBackend
from controlplane.lifecycle import apply_exit, apply_probe
from controlplane.prober import Prober, ProbeResult
from controlplane.reconcile import Controller, ControllerConfig, run_controller
from controlplane.records import ReplicaRecord
from controlplane.servicespec import ReadinessProbe, ServiceSpec, parse_spec
from controlplane.states import ReplicaStatus, ServiceStatus, UpdateMode
from controlplane.store import ServiceExists, ServiceNotFound, Store
from proxy.wire.snapshot import ReadySnapshot, decode_snapshot
from tests.support.builders import PROBE, RUN, make_spec, pid_of, ready_view
from tests.support.controllers import proxy_for
from tests.support.fakes import StartController, controller_config
from tests.support.pids import running
from tests.support.poll import until
from tests.support.ports import free_port
from tests.support.processes import REPO, ProxyFactory, ReplicaFactory
from tests.support.traffic import Traffic


@pytest.fixture
def config(redis_url: str, redis_prefix: str, tmp_path: Path) -> ControllerConfig:
    return controller_config(redis_url, redis_prefix, tmp_path)


class SnapshotWatcher:
    """Every snapshot published on a service's ready channel, in order."""

    def __init__(self, client: aioredis.Redis, store: Store, name: str) -> None:
        self.snapshots: list[ReadySnapshot] = []
        self._pubsub = client.pubsub()
        self._channel = store.keys.ready(name)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> SnapshotWatcher:
        await self._pubsub.subscribe(self._channel)
        self._task = asyncio.create_task(self._collect())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _collect(self) -> None:
        while True:
            message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None and message["type"] == "message":
                self.snapshots.append(decode_snapshot(message["data"]))

    def after_first_ready(self) -> list[ReadySnapshot]:
        for i, snapshot in enumerate(self.snapshots):
            if snapshot.replicas:
                return self.snapshots[i:]
        return []


async def event_kinds(store: Store, name: str) -> list[str]:
    return [e.kind for e in await store.events(name, count=1000)]


# -- lifecycle with real replicas ----------------------------------------------------------


async def test_up_serves_the_replicas_then_down_removes_everything(
    store: Store, start_controller: StartController, config: ControllerConfig
) -> None:
    await start_controller()
    record = await ops.up(store, "svc", make_spec(2), endpoint="http://127.0.0.1:1")
    assert record.version == 1 and record.status is ServiceStatus.CONTROLLER_INIT

    view = await ready_view(store, "svc", 2)
    assert view.status == "READY" and view.ready == 2 and view.total == 2
    assert view.active_versions == [1] and view.endpoint == "http://127.0.0.1:1"
    snapshot = await store.snapshot("svc")
    assert snapshot is not None and snapshot.status == "READY"
    assert [r.id for r in snapshot.replicas] == [1, 2]
    assert [r.url for r in snapshot.replicas] == [r.url for r in view.replicas]

    # Each replica got its own port, id and the spec's envs, ran in workdir, logs to a file.
    async with aiohttp.ClientSession() as session:
        for replica in view.replicas:
            async with session.get(f"{replica.url}/fast") as resp:
                assert resp.status == 200
                assert resp.headers["X-Replica-Id"] == str(replica.id)
    for replica_id in (1, 2):
        assert (config.state_dir / "svc" / f"replica-{replica_id}.log").exists()
    kinds = await event_kinds(store, "svc")
    assert kinds.count("launch") == 2 and kinds.count("ready") == 2

    pids = [pid_of(r) for r in (await store.replicas("svc")).values()]
    assert all(running(pid) for pid in pids)
    await ops.down(store, "svc")
    await until(lambda: not any(running(pid) for pid in pids), timeout=15, what="terminated")

    async def unregistered() -> bool:
        return not await store.services()

    await until(unregistered, timeout=15, what="the service to be unregistered")
    final = await store.snapshot("svc")
    assert final is not None and final.status == "SHUTTING_DOWN" and final.replicas == ()


async def test_count_only_scale_2_3_2_relabels_in_one_commit_and_keeps_replicas(
    store: Store,
    redis_client: aioredis.Redis,
    start_controller: StartController,
) -> None:
    await start_controller()
    await ops.up(store, "svc", make_spec(2))
    await ready_view(store, "svc", 2)
    pids = {i: pid_of(r) for i, r in (await store.replicas("svc")).items()}

    async with SnapshotWatcher(redis_client, store, "svc") as watcher:
        published = len(watcher.snapshots)
        assert await ops.update(store, "svc", make_spec(3)) == 2
        await ready_view(store, "svc", 3, version=2)
        # The first snapshot after the update already routes the relabelled replicas.
        first = watcher.snapshots[published]
        assert first.active_versions == [2] and [r.id for r in first.replicas] == [1, 2]

        published = len(watcher.snapshots)
        assert await ops.update(store, "svc", make_spec(2)) == 3
        await ready_view(store, "svc", 2, version=3)
        first = watcher.snapshots[published]
        # Relabel and the retirement of replica 3 (largest id) are one commit.
        assert first.active_versions == [3] and [r.id for r in first.replicas] == [1, 2]

    replicas = await store.replicas("svc")
    assert sorted(replicas) == [1, 2]
    assert {i: pid_of(r) for i, r in replicas.items()} == pids  # never replaced
    assert all(s.replicas for s in watcher.after_first_ready())
    kinds = await event_kinds(store, "svc")
    assert kinds.count("launch") == 3 and kinds.count("terminate") == 1


@pytest.mark.parametrize("mode", [UpdateMode.ROLLING, UpdateMode.BLUE_GREEN])
async def test_spec_update_replaces_replicas_without_a_failed_request(
    mode: UpdateMode,
    store: Store,
    redis_client: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    start_controller: StartController,
    proxy_factory: ProxyFactory,
) -> None:
    await start_controller()
    await ops.up(store, "svc", make_spec(2))
    await ready_view(store, "svc", 2)
    url = await proxy_for(proxy_factory, redis_url, redis_prefix, "svc")

    async with SnapshotWatcher(redis_client, store, "svc") as watcher:
        async with Traffic(url, rate=20) as traffic:
            def seen(*replicas: str) -> bool:
                return {o.replica for o in traffic.outcomes} >= set(replicas)

            # Both old replicas served before the update (on a busy machine the first
            # requests may all land on one), so the check below is on the replacement.
            await until(lambda: seen("1", "2"), what="traffic on replicas 1 and 2")
            await ops.update(store, "svc", make_spec(2, env="b"), mode=mode)
            await ready_view(store, "svc", 2, version=2)
            await until(lambda: seen("3", "4"), what="traffic on replicas 3 and 4")

    assert traffic.failures() == [], traffic.failures()[:5]
    assert traffic.slower_than(2.0) == []
    assert {o.replica for o in traffic.outcomes} >= {"1", "2", "3", "4"}
    snapshots = watcher.snapshots
    assert snapshots and all(s.replicas for s in snapshots), "the ready set went empty"
    if mode is UpdateMode.BLUE_GREEN:
        assert all(len(s.active_versions) == 1 for s in snapshots)
        # Switched at once: no snapshot mixes versions.
        assert all(len({r.version for r in s.replicas}) == 1 for s in snapshots)
    assert snapshots[-1].active_versions == [2]
    assert sorted(await store.replicas("svc")) == [3, 4]


async def test_drain_keeps_an_in_flight_request_alive(
    store: Store,
    redis_url: str,
    redis_prefix: str,
    start_controller: StartController,
    proxy_factory: ProxyFactory,
) -> None:
    await start_controller(drain_seconds=4.0)
    await ops.up(store, "svc", make_spec(2))
    view = await ready_view(store, "svc", 2)
    url = await proxy_for(proxy_factory, redis_url, redis_prefix, "svc")

    async def slow(session: aiohttp.ClientSession) -> tuple[int, str]:
        async with session.get(f"{url}/slow?delay=2.5") as resp:
            await resp.read()
            return resp.status, resp.headers["X-Replica-Id"]

    async def in_flight(replica_url: str) -> int:
        async with aiohttp.ClientSession() as s, s.get(f"{replica_url}/stats") as resp:
            n: int = (await resp.json())["in_flight"]
            return n

    async with aiohttp.ClientSession() as session:
        requests = [asyncio.create_task(slow(session)) for _ in range(2)]
        async def spread() -> bool:
            return [await in_flight(r.url or "") for r in view.replicas] == [1, 1]

        await until(spread, timeout=5, what="one slow request on each replica")
        await ops.update(store, "svc", make_spec(1))
        draining = await ops.wait_for(
            store, "svc", lambda v: any(r.status == "SHUTTING_DOWN" for r in v.replicas), 5
        )
        assert [r.id for r in draining.replicas if r.status == "SHUTTING_DOWN"] == [2]
        snapshot = await store.snapshot("svc")
        assert snapshot is not None and [r.id for r in snapshot.replicas] == [1]
        results = await asyncio.gather(*requests)

    assert sorted(results) == [(200, "1"), (200, "2")]
    pid = pid_of(next(r for r in (await store.replicas("svc")).values() if r.id == 2))
    await ready_view(store, "svc", 1)  # replica 2 terminated after the drain and deleted
    assert not running(pid)


async def test_killed_replica_is_replaced(store: Store, start_controller: StartController) -> None:
    await start_controller()
    await ops.up(store, "svc", make_spec(2))
    await ready_view(store, "svc", 2)
    victim = (await store.replicas("svc"))[2]
    os.killpg(pid_of(victim), signal.SIGKILL)

    view = await ops.wait_for(
        store,
        "svc",
        lambda v: sorted(r.id for r in v.replicas) == [1, 3] and v.ready == 2,
        timeout=20,
    )
    assert view.status == "READY"
    failures = [e for e in await store.events("svc", count=1000) if e.kind == "failure"]
    assert (
        len(failures) == 1 and "killed by SIGKILL after being ready" in failures[0].fields["reason"]
    )
    snapshot = await store.snapshot("svc")
    assert snapshot is not None and [r.id for r in snapshot.replicas] == [1, 3]


async def test_a_never_ready_version_stops_launching_and_status_says_why(
    store: Store, start_controller: StartController
) -> None:
    controller = await start_controller()
    await ops.up(store, "svc", make_spec(1))
    await ready_view(store, "svc", 1)

    # v2: the user's command exits at once.
    await ops.update(store, "svc", make_spec(1, run="echo boom >&2; exit 3"))
    view = await ops.wait_for(store, "svc", lambda v: v.launch_blocked is not None, 15)
    for _ in range(3):
        await controller.step()
    view = (await ops.status(store, "svc"))[0]
    assert view.launch_blocked is not None and "exited with code 3" in view.launch_blocked
    assert view.status == "READY"  # v1 keeps serving
    assert [(r.id, r.version, r.status) for r in view.replicas] == [
        (1, 1, "READY"), (2, 2, "FAILED"),
    ]  # fmt: skip
    events = await store.events("svc", count=1000)
    assert [e.fields["version"] for e in events if e.kind == "launch"] == ["1", "2"]
    snapshot = await store.snapshot("svc")
    assert snapshot is not None and [r.id for r in snapshot.replicas] == [1]

    # v3: listens but never answers the readiness probe within the initial delay.
    await ops.update(
        store,
        "svc",
        make_spec(1, run=f"{RUN} --ready-delay 1000", probe={"initial_delay_seconds": 1}),
    )
    view = await ops.wait_for(
        store, "svc", lambda v: any(r.status == "FAILED_INITIAL_DELAY" for r in v.replicas), 15
    )
    assert view.launch_blocked is not None
    # The reason comes from the failure event, which the controller appends after the
    # commit that set the status (a launch never waits on an event write): a status read
    # between the two says the version is blocked, without the reason yet.
    view = await ops.wait_for(
        store, "svc",
        lambda v: v.launch_blocked is not None and "initial_delay_seconds=1" in v.launch_blocked,
        15,
    )  # fmt: skip
    failed = next(r for r in (await store.replicas("svc")).values() if r.version == 3)
    await until(lambda: not failed.handle or not running(pid_of(failed)), timeout=10)

    # v4 works again: it replaces v1, and the failed records of older versions go.
    await ops.update(store, "svc", make_spec(1, env="fixed"))
    view = await ready_view(store, "svc", 1, version=4)
    assert view.launch_blocked is None and view.status == "READY"


async def failed_then_stepped(
    store: Store, start_controller: StartController, spec: ServiceSpec
) -> ops.ServiceView:
    """`spec` up until the service is FAILED; its view after 3 more controller steps
    (which must not start another round)."""
    controller = await start_controller()
    await ops.up(store, "svc", spec)
    await ops.wait_for(store, "svc", lambda v: v.status == "FAILED", 15)
    for _ in range(3):
        await controller.step()
    return (await ops.status(store, "svc"))[0]


async def test_a_service_that_never_gets_ready_is_failed(
    store: Store, start_controller: StartController
) -> None:
    view = await failed_then_stepped(store, start_controller, make_spec(2, run="exit 1"))
    assert view.status == "FAILED" and view.ready == 0
    assert view.launch_blocked is not None and "exited with code 1" in view.launch_blocked
    assert (await event_kinds(store, "svc")).count("launch") == 2  # one round, no loop
    assert view.last_failure is not None and "before it was ever ready" in view.last_failure


async def test_a_failed_setup_gives_up_a_version_that_never_served(
    store: Store, start_controller: StartController
) -> None:
    # Sky: a setup that fails is FAILED_SETUP, a user-code failure (FAILED), not a
    # provisioning failure to retry; so one round of launches, not a loop.
    spec = make_spec(2, setup="echo no deps >&2; exit 4")
    view = await failed_then_stepped(store, start_controller, spec)
    assert view.status == "FAILED" and {r.status for r in view.replicas} == {"FAILED"}
    assert view.launch_blocked is not None and "setup of version 1 exited with code 4" in (
        view.launch_blocked
    )
    assert (await event_kinds(store, "svc")).count("launch") == 2


async def test_down_unregisters_a_service_whose_version_gave_up(
    store: Store, start_controller: StartController
) -> None:
    # The FAILED records of a version that gave up stay for `status` to explain why;
    # taking the service down must still remove them, or `down` (and `sluice run`'s
    # Ctrl-C) waits for a service that is never unregistered.
    controller = await start_controller()
    await ops.up(store, "svc", make_spec(2, setup="exit 4"))
    await ops.wait_for(store, "svc", lambda v: v.status == "FAILED", 15)
    await ops.down(store, "svc")
    for _ in range(3):
        await controller.step()
    assert await store.service("svc") is None
    assert await store.replicas("svc") == {}


# Replica 2 never answers its readiness probe; every other replica is ready at once.
SLOW_2 = RUN + ' --ready-delay "$([ "$SLUICE_REPLICA_ID" = 2 ] && echo 1000 || echo 0)"'


async def test_a_version_that_served_keeps_scaling_after_a_slow_replica(
    store: Store, start_controller: StartController
) -> None:
    # Sky Serve 0.14.1 (autoscalers.py, generate_scaling_decisions): scaling stops for an
    # unrecoverable failure only while `latest_version_ever_ready < latest_version`.
    await start_controller()
    await ops.up(store, "svc", make_spec(1, run=SLOW_2))
    await ready_view(store, "svc", 1)
    # Count-only: replica 1 is relabelled, so version 2 has served from the start.
    await ops.update(store, "svc", make_spec(2, run=SLOW_2, probe={"initial_delay_seconds": 4}))
    view = await ops.wait_for(
        store,
        "svc",
        lambda v: v.ready == 2 and all(r.status == "READY" for r in v.replicas),
        timeout=40,
    )
    assert [r.id for r in view.replicas] == [1, 3] and view.launch_blocked is None
    assert {r.version for r in view.replicas} == {2}
    failures = [e for e in await store.events("svc", count=1000) if e.kind == "failure"]
    assert [e.fields["status"] for e in failures] == ["FAILED_INITIAL_DELAY"]
    assert (await store.service("svc")).ready_version == 2  # type: ignore[union-attr]


class FakeCloudOutOfCapacity(LocalBackend):
    """A fake of what cannot run here, a cloud: its first provisioning fails for want of
    capacity (LaunchFailed); later ones run the replica as the local backend does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attempts = 0

    async def launch(
        self, service: str, replica_id: int, version: int, spec: ServiceSpec
    ) -> Launched:
        self.attempts += 1
        if self.attempts == 1:
            raise LaunchFailed("fake cloud: no A100 capacity in us-east-1")
        return await super().launch(service, replica_id, version, spec)


async def test_a_failed_provision_is_retried_not_given_up(
    store: Store, config: ControllerConfig
) -> None:
    # Sky: FAILED_PROVISION is not `unrecoverable_failure` (replica_managers.py): the
    # autoscaler launches another replica, even for a version never READY yet.
    cloud = FakeCloudOutOfCapacity(config.state_dir, term_timeout=config.term_timeout)
    controller = Controller(store, config, backends={"local": cloud, "external": ExternalBackend()})
    await controller.start()
    runner = asyncio.create_task(controller.run())
    try:
        await ops.up(store, "svc", make_spec(1))
        view = await ready_view(store, "svc", 1)
        assert [r.id for r in view.replicas] == [2] and view.status == "READY"
        failures = [e for e in await store.events("svc", count=1000) if e.kind == "failure"]
        assert len(failures) == 1 and "no A100 capacity" in failures[0].fields["reason"]
        assert failures[0].fields["status"] == "FAILED_PROVISION" and cloud.attempts == 2
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        await controller.aclose()


async def test_a_replica_on_the_yamls_fixed_port_is_probed_there(
    store: Store, start_controller: StartController
) -> None:
    # A Sky Serve YAML: the run command listens on the port the YAML names, not $PORT.
    port = free_port()
    run = RUN.replace("$PORT", str(port))  # the port the YAML names
    doc: dict[str, Any] = {
        "service": {"readiness_probe": PROBE, "replicas": 1, "ports": port},
        "resources": {"ports": port},
        "workdir": str(REPO),
        "run": run,
    }
    await start_controller()
    await ops.up(store, "svc", parse_spec(doc))
    view = await ready_view(store, "svc", 1)
    assert view.replicas[0].url == f"http://127.0.0.1:{port}"
    [replica] = (await store.replicas("svc")).values()
    assert replica.handle["port"] == port


async def test_external_replicas_are_probed_and_routed_never_killed(
    store: Store, start_controller: StartController, replica_factory: ReplicaFactory
) -> None:
    await start_controller()
    (replica,) = await replica_factory.astart(1)
    await ops.up(store, "ext", make_spec(1, run=None))
    replica_id = await ops.add_replica(store, "ext", replica.url, accelerator="A100:1")
    with pytest.raises(ops.ReplicaExists):
        await ops.add_replica(store, "ext", replica.url + "/")
    view = await ready_view(store, "ext", 1)
    assert view.replicas[0].backend == "external" and view.replicas[0].accelerator == "A100:1"
    snapshot = await store.snapshot("ext")
    assert snapshot is not None and [r.url for r in snapshot.replicas] == [replica.url]

    # An update relabels it (nothing can replace it).
    await ops.update(store, "ext", make_spec(3, run=None, env="b"))
    await ready_view(store, "ext", 1, version=2)

    await ops.remove_replica(store, "ext", replica.url)
    snapshot = await store.snapshot("ext")
    assert snapshot is not None and snapshot.replicas == ()
    await ops.wait_for(store, "ext", lambda v: v.replicas == [], 10)
    assert replica.alive
    kinds = await event_kinds(store, "ext")
    assert "drain" in kinds and "terminate" in kinds
    with pytest.raises(ops.ReplicaNotFound):
        await ops.remove_replica(store, "ext", replica.url)
    assert replica_id == 1


async def test_leader_failover_adopts_the_replicas(
    store: Store, config: ControllerConfig, tmp_path: Path
) -> None:
    leader_config = dataclasses.replace(config, holder="leader", terminate_on_exit=False)
    script = (
        "import asyncio, logging, sys\n"
        "from pathlib import Path\n"
        "from controlplane.reconcile import ControllerConfig, run_controller\n"
        "logging.basicConfig(level=logging.INFO)\n"
        f"config = ControllerConfig(redis_url={config.redis_url!r}, prefix={config.prefix!r},"
        f" state_dir=Path({str(config.state_dir)!r}), lease_ttl={config.lease_ttl},"
        f" drain_seconds=1.0, reconcile_interval=30.0, holder={leader_config.holder!r})\n"
        "asyncio.run(run_controller(config))\n"
    )
    with open(tmp_path / "leader.log", "wb") as out:
        leader = subprocess.Popen(
            [sys.executable, "-c", script], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    standby_started = asyncio.Event()
    standby: asyncio.Task[None] | None = None
    try:
        async def leading() -> bool:
            assert leader.poll() is None, (tmp_path / "leader.log").read_text()
            return (await store.lease_holder() or "").startswith("leader:")

        await until(leading, timeout=15, what="the leader to take the lease")
        standby = asyncio.create_task(
            run_controller(dataclasses.replace(config, holder="standby"), started=standby_started)
        )
        await ops.up(store, "svc", make_spec(2))
        await ready_view(store, "svc", 2)
        assert not standby_started.is_set()
        pids = {i: pid_of(r) for i, r in (await store.replicas("svc")).items()}

        leader.kill()  # no chance to release the lease or stop anything
        leader.wait()
        async with asyncio.timeout(10):
            await standby_started.wait()
        assert (await store.lease_holder() or "").startswith("standby:")

        # The new leader adopts the running replicas (same processes) and acts.
        await ops.update(store, "svc", make_spec(3))
        await ready_view(store, "svc", 3, version=2)
        replicas = await store.replicas("svc")
        assert {i: pid_of(replicas[i]) for i in (1, 2)} == pids
        assert all(running(pid) for pid in pids.values())
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()
        if standby is not None:
            standby.cancel()  # terminate_on_exit: stops every replica, adopted ones too
            with contextlib.suppress(asyncio.CancelledError):
                await standby
    assert not any(running(pid) for pid in pids.values())
    assert await store.lease_holder() is None  # released on the way out


# -- ops without a controller --------------------------------------------------------------


async def test_ops_errors(store: Store) -> None:
    with pytest.raises(ServiceNotFound):
        await ops.update(store, "nope", make_spec(1))
    with pytest.raises(ServiceNotFound):
        await ops.status(store, "nope")
    with pytest.raises(ServiceNotFound):
        await ops.down(store, "nope")
    await ops.up(store, "svc", make_spec(1))
    with pytest.raises(ServiceExists):
        await ops.up(store, "svc", make_spec(1))
    with pytest.raises(ValueError):
        await ops.add_replica(store, "svc", "not a url")
    assert await ops.update(store, "svc", make_spec(2), mode=UpdateMode.BLUE_GREEN) == 2
    record = await store.service("svc")
    assert record is not None and record.update_mode is UpdateMode.BLUE_GREEN
    assert record.min_replicas == {1: 1, 2: 2}
    stored = await store.spec("svc", 2)
    assert stored is not None and ServiceSpec.from_json(stored) == make_spec(2)
    await ops.down(store, "svc")
    with pytest.raises(ops.ServiceShuttingDown):
        await ops.update(store, "svc", make_spec(3))
    with pytest.raises(ops.ServiceShuttingDown):
        await ops.add_replica(store, "svc", "http://127.0.0.1:9")
    (view,) = await ops.status(store)
    assert view.status == "SHUTTING_DOWN" and view.version == 2
    with pytest.raises(TimeoutError):
        await ops.wait_for(store, "svc", lambda v: v.ready > 0, timeout=0.2)


# -- the local backend ----------------------------------------------------------------------


async def test_local_backend_setup_once_env_workdir_and_termination(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    spec = parse_spec(
        {
            "service": {"readiness_probe": "/", "replicas": 1},
            "workdir": str(workdir),
            "envs": {"GREETING": "hi"},
            "setup": "echo ran >> setup.count",
            # The trap comes first: once out-N is written, SIGTERM is ignored.
            "run": "trap '' TERM; "
            'echo "$PORT $SLUICE_REPLICA_ID $SKYPILOT_SERVE_REPLICA_ID $GREETING $PWD"'
            " > out-$SLUICE_REPLICA_ID; exec sleep 60",
        }
    )
    backend = LocalBackend(tmp_path / "state", term_timeout=0.3)
    await backend.start()
    launched = await asyncio.gather(*(backend.launch("svc", i, 1, spec) for i in (1, 2)))
    await backend.launch("svc", 3, 1, spec)
    assert (workdir / "setup.count").read_text() == "ran\n"  # once per version
    await until(lambda: (workdir / "out-2").exists(), what="replica output")
    port = launched[1].handle["port"]
    await until(lambda: (workdir / "out-2").read_text().strip() != "", what="output")
    assert (workdir / "out-2").read_text().split() == [str(port), "2", "2", "hi", str(workdir)]
    assert launched[1].url == f"http://127.0.0.1:{port}"
    assert all(backend.exited(x.handle) is None for x in launched)

    # A successor adopts by pid (the handle, or the handle file if never recorded).
    successor = LocalBackend(tmp_path / "state", term_timeout=0.3)
    recovered = successor.recover("svc", 2)
    assert recovered is not None and recovered.handle == launched[1].handle
    assert successor.exited(launched[0].handle) is None
    # Replica 1 must have set its trap before the SIGTERM, or it dies of it.
    await until(lambda: (workdir / "out-1").exists() and (workdir / "out-1").read_text()
                     .strip() != "", what="replica 1 output")
    await successor.terminate(launched[0].handle)  # ignores SIGTERM: SIGKILLed
    assert successor.exited(launched[0].handle) is not None
    assert backend.exited(launched[0].handle) == "killed by SIGKILL"
    assert successor.recover("svc", 1) is None
    for replica_id in (2, 3):
        handle = successor.recover("svc", replica_id)
        assert handle is not None
        await backend.terminate(handle.handle)
    await backend.aclose()


async def test_local_backend_failed_setup_fails_the_launch(tmp_path: Path) -> None:
    spec = parse_spec(
        {"service": {"replicas": 1}, "setup": "exit 4", "run": "sleep 1", "workdir": "."}
    )
    backend = LocalBackend(tmp_path, base_dir=tmp_path)
    with pytest.raises(Exception, match="setup of version 1 exited with code 4"):
        await backend.launch("svc", 1, 1, spec)
    await backend.aclose()


# -- the prober ------------------------------------------------------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def probing(handler: Handler) -> AsyncIterator[tuple[str, Prober, asyncio.Event]]:
    """`handler` served on a free port (its URL), and a started real Prober setting the
    event on each result; both closed on exit."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    try:
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        woken = asyncio.Event()
        prober = Prober(clock=time.time, on_result=woken.set)
        await prober.start()
        try:
            yield f"http://127.0.0.1:{port}", prober, woken
        finally:
            await prober.aclose()
    finally:
        await runner.cleanup()


async def probe_results(
    prober: Prober, woken: asyncio.Event, targets: list[tuple[ReplicaRecord, ReadinessProbe]],
    timeout: float,
) -> dict[int, ProbeResult]:  # fmt: skip
    """Poll on each result until every target has one (within `timeout` s)."""
    results: dict[int, ProbeResult] = {}
    async with asyncio.timeout(timeout):
        while len(results) < len(targets):
            await woken.wait()
            woken.clear()
            results.update(prober.poll("svc", targets, time.time()))
    return results


async def test_prober_probes_concurrently_each_with_its_own_timeout() -> None:
    seen: list[tuple[str, str, bytes, str | None]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(
            (request.method, request.path, await request.read(), request.headers.get("X-Key"))
        )
        match request.path:
            case "/slow":
                await asyncio.sleep(5)
            case "/down":
                return web.Response(status=503)
        return web.Response(text="ok")

    async with probing(handler) as (url, prober, woken):
        closed = f"http://127.0.0.1:{free_port()}"

        def replica(i: int, at: str = url) -> ReplicaRecord:
            return ReplicaRecord(id=i, status=ReplicaStatus.STARTING, url=at)

        targets = [
            (replica(1), ReadinessProbe(path="/ok")),
            (replica(2), ReadinessProbe(path="/slow", timeout_seconds=0.5)),
            (replica(3), ReadinessProbe(path="/down")),
            (replica(4), ReadinessProbe(path="/p", post_data={"q": 1}, headers={"X-Key": "k"})),
            (replica(5, closed), ReadinessProbe(path="/ok")),
        ]
        started = time.monotonic()
        assert prober.poll("svc", targets, time.time()) == {}  # never waits for a probe
        assert time.monotonic() - started < 0.1
        results = await probe_results(prober, woken, targets, 5)
        assert {i: r.ok for i, r in results.items()} == {1: True, 2: False, 3: False, 4: True,
                                                         5: False}  # fmt: skip
        assert results[2].detail == "timeout after 0.5s" and results[3].detail == "503"
        assert ("POST", "/p", b'{"q":1}', "k") in seen and ("GET", "/ok", b"", None) in seen
        assert time.monotonic() - started < 2  # concurrent: bounded by the slowest timeout


def test_probe_state_machine() -> None:
    replace = msgspec.structs.replace
    probe = ReadinessProbe(
        path="/h", initial_delay_seconds=10, consecutive_failure_threshold_timeout=5
    )
    url = "http://127.0.0.1:1"
    ok = ProbeResult(1, True, "200", url)
    bad = ProbeResult(1, False, "503", url)
    starting = ReplicaRecord(id=1, status=ReplicaStatus.STARTING, url=url, launched_at=100.0)

    first = apply_probe(starting, bad, probe, 105.0)  # the initial delay starts here
    assert first.record == replace(starting, first_not_ready_at=105.0) and first.event is None
    assert apply_probe(first.record, bad, probe, 115.0).record == first.record  # 10s: not > 10
    late = apply_probe(first.record, bad, probe, 115.5)
    assert late.record.status is ReplicaStatus.FAILED_INITIAL_DELAY and late.event == "failure"

    ready = apply_probe(starting, ok, probe, 105.0)
    assert ready.event == "ready" and ready.record.status is ReplicaStatus.READY
    assert ready.record.first_ready_at == 105.0
    dip = apply_probe(ready.record, bad, probe, 120.0)
    assert dip.event == "not_ready" and dip.record.status is ReplicaStatus.NOT_READY
    still = apply_probe(dip.record, bad, probe, 124.0)
    assert still.record.status is ReplicaStatus.NOT_READY and still.record.failures == 2
    back = apply_probe(still.record, ok, probe, 124.5)
    assert back.record.status is ReplicaStatus.READY and back.record.failures == 0
    assert back.record.first_ready_at == 105.0
    gone = apply_probe(apply_probe(back.record, bad, probe, 130).record, bad, probe, 135.5)
    assert gone.record.status is ReplicaStatus.FAILED_PROBING and gone.event == "failure"

    # A result for a replica that moved (another URL) or left is ignored.
    moved = replace(ready.record, url="http://127.0.0.1:2")
    assert apply_probe(moved, bad, probe, 130.0).record == moved
    exited = apply_exit(ready.record, "exited with code 1", 130.0)
    assert exited.record.status is ReplicaStatus.FAILED
    assert exited.reason == "process exited with code 1 after being ready"


def test_initial_delay_counts_from_the_first_failed_probe_as_in_sky() -> None:
    # Sky Serve 0.14.1, replica_managers.py `_probe_all_replicas`: `first_not_ready_time`
    # is set by the first failed probe; FAILED_INITIAL_DELAY once
    # `probe_time - first_not_ready_time > initial_delay_seconds`. Launch time plays no part
    # (a replica whose setup or first probe came late is not charged for it).
    probe = ReadinessProbe(path="/h", initial_delay_seconds=60)
    url = "http://127.0.0.1:1"
    bad = ProbeResult(1, False, "connect: refused", url)
    launched = ReplicaRecord(id=1, status=ReplicaStatus.STARTING, url=url, launched_at=0.0)
    first = apply_probe(launched, bad, probe, 100.0).record
    assert first.status is ReplicaStatus.STARTING and first.first_not_ready_at == 100.0
    assert apply_probe(first, bad, probe, 150.0).record.status is ReplicaStatus.STARTING
    assert apply_probe(first, bad, probe, 160.0).record.status is ReplicaStatus.STARTING
    failed = apply_probe(first, bad, probe, 160.5)
    assert failed.record.status is ReplicaStatus.FAILED_INITIAL_DELAY
    assert "initial_delay_seconds=60" in (failed.reason or "")


async def test_probe_follows_redirects_like_requests_bounded() -> None:
    async def handler(request: web.Request) -> web.Response:
        match request.path:
            case "/health":  # e.g. a framework adding a trailing slash
                raise web.HTTPMovedPermanently("/health/")
            case "/health/":
                return web.Response(text=f"ok {request.method}")
            case "/post":  # a 302 to a POST: requests (and so Sky) re-asks with a GET
                raise web.HTTPFound("/health/")
            case "/keep":  # a 307 keeps the POST and its body
                raise web.HTTPTemporaryRedirect("/echo")
            case "/echo":
                body = await request.read()
                return web.Response(status=200 if request.method == "POST" and body else 400)
            case "/loop":
                raise web.HTTPFound("/loop")
        return web.Response(status=404)

    async with probing(handler) as (url, prober, woken):
        targets = [
            (ReplicaRecord(id=i, status=ReplicaStatus.STARTING, url=url), probe)
            for i, probe in enumerate(
                [
                    ReadinessProbe(path="/health"),
                    ReadinessProbe(path="/post", post_data={"q": 1}),
                    ReadinessProbe(path="/keep", post_data={"q": 1}),
                    ReadinessProbe(path="/loop", timeout_seconds=10),
                ],
                start=1,
            )
        ]
        prober.poll("svc", targets, time.time())
        results = await probe_results(prober, woken, targets, 15)
        assert {i: r.ok for i, r in results.items()} == {1: True, 2: True, 3: True, 4: False}
        assert "TooManyRedirects" in results[4].detail


async def test_control_subscription_decodes_nudges(
    store: Store, redis_client: aioredis.Redis
) -> None:
    subscription = await store.subscribe_control()
    try:
        assert await subscription.get(timeout=0.05) is None
        await store.nudge("svc", reason="demand")
        await redis_client.publish(store.keys.control, b"other")
        await redis_client.publish(store.keys.control, b'{"service": 1}')  # invalid: skipped
        await redis_client.publish(store.keys.control, b"last")
        got: list[tuple[str, str]] = []
        deadline = time.monotonic() + 5
        while len(got) < 3:
            assert time.monotonic() < deadline, got
            nudge = await subscription.get(timeout=1)
            if nudge is not None:
                got.append((nudge.service, nudge.reason))
        assert got == [("svc", "demand"), ("other", "changed"), ("last", "changed")]
    finally:
        await subscription.aclose()
