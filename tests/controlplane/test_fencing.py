"""Fencing: controller commits are conditional on holding the leader lease, and lease
holder ids are unique per process. Real `sluice controller` processes, real local
replicas and a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis

from controlplane import ops
from controlplane.reconcile import Controller, ControllerConfig
from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.redisserver import EmbeddedRedis
from controlplane.states import ReplicaStatus
from controlplane.store import LeaseLost, Mutation, Store
from tests.support.builders import make_spec, pid_of, ready_view
from tests.support.cli import spawn_sluice
from tests.support.faultproxy import FaultProxy
from tests.support.pids import running
from tests.support.poll import until


class ControllerProcess:
    """`sluice controller` as a child process, logging to a file."""

    def __init__(self, log: Path, argv: list[str]) -> None:
        self.log = log
        self.proc = spawn_sluice(["controller", *argv], log)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def controllers(redis_url: str, redis_prefix: str, tmp_path: Path) -> Iterator[
    list[ControllerProcess]
]:
    """Start with `controllers.append(ControllerProcess(...))`; stopped at teardown."""
    started: list[ControllerProcess] = []
    yield started
    for controller in started:
        controller.stop()


def lease_expired(store: Store) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await store.lease_holder() is None

    return check


async def stepped_down(leader: ControllerProcess, since: int) -> None:
    """Wait for `leader` to log its step-down after offset `since`; a timeout shows its log."""
    try:
        await until(
            lambda: "lost the lease; standing by" in leader.text()[since:],
            timeout=30, what="the resumed leader to step down",
        )  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- its log ---\n{leader.text()}") from None


def controller_argv(
    redis_url: str, prefix: str, state_dir: Path, holder: str, ttl: float
) -> list[str]:
    # TTLs of a few seconds: a renewal counts as failed after a third of it, and a busy
    # 2-core box must not make a healthy leader step down in the middle of a test.
    return ["--redis", redis_url, "--prefix", prefix, "--state-dir", str(state_dir),
            "--holder", holder, "--lease-ttl", str(ttl), "--drain-seconds", "0",
            "--reconcile-interval", "30", "--term-timeout", "3"]  # fmt: skip


async def test_two_controllers_with_the_same_holder_one_leads(
    controllers: list[ControllerProcess],
    redis_url: str,
    redis_prefix: str,
    store: Store,
    tmp_path: Path,
) -> None:
    argv = controller_argv(redis_url, redis_prefix, tmp_path / "state", "ctl", ttl=5)
    for i in range(2):
        controllers.append(ControllerProcess(tmp_path / f"c{i}.log", argv))

    def roles() -> list[str]:
        texts = [c.text() for c in controllers]
        return sorted(
            ("leads" if ": leading" in t else "") + ("stands by" if "standing by" in t else "")
            for t in texts
        )

    # Each logs whether it took the lease or found it taken; both starting up counts.
    await until(lambda: all(roles()), timeout=30, what="both controllers to start")
    assert roles() == ["leads", "stands by"], [c.text() for c in controllers]
    holder = await store.lease_holder()
    assert holder is not None and holder.startswith("ctl:") and holder != "ctl"

    # The standby takes over when the leader dies without releasing the lease.
    leader = next(c for c in controllers if ": leading" in c.text())
    standby = next(c for c in controllers if c is not leader)
    leader.proc.kill()
    leader.proc.wait()
    await until(lambda: ": leading" in standby.text(), timeout=30, what="a takeover")
    new_holder = await store.lease_holder()
    assert new_holder is not None and new_holder.startswith("ctl:") and new_holder != holder


@pytest.mark.timeout(120)
async def test_a_leader_paused_past_its_lease_steps_down_without_touching_the_fleet(
    controllers: list[ControllerProcess],
    redis_url: str,
    redis_prefix: str,
    store: Store,
    tmp_path: Path,
) -> None:
    # A TTL of 6 s: with 3 s a renewal answered later than 1 s (a loaded CI box) made the
    # leader step down before the pause, and the test then waited for a second step-down.
    argv = controller_argv(redis_url, redis_prefix, tmp_path / "state", "ctl", ttl=6)
    leader = ControllerProcess(tmp_path / "leader.log", argv)
    controllers.append(leader)
    await ops.up(store, "svc", make_spec(1))
    await ready_view(store, "svc", 1)
    before = await store.replicas("svc")
    replica_pid = pid_of(before[1])
    try:
        # Paused while leading: the lease is its own (only a renewal failing in the moment
        # between this check and the SIGSTOP could still make it step down first).
        holder = await store.lease_holder()
        assert holder is not None and holder.startswith("ctl:"), leader.text()
        leader.proc.send_signal(signal.SIGSTOP)
        # Past its TTL: the lease expires, and a successor takes it. Its value is what a
        # second controller started with the same --holder used to write.
        await until(lease_expired(store), timeout=30, what="the lease to expire")
        assert await store.lease("ctl", 60).acquire()
        # The fleet needs repair: the paused leader would replace this replica.
        os.killpg(replica_pid, signal.SIGKILL)
        await until(lambda: not running(replica_pid), what="the replica to die")
        await store.nudge("svc")
        resumed_at = len(leader.text())
        leader.proc.send_signal(signal.SIGCONT)

        await stepped_down(leader, resumed_at)
        after = leader.text()[resumed_at:]
        assert leader.proc.poll() is None, after
        # It launched nothing and wrote nothing: the records are as it left them.
        assert await store.replicas("svc") == before, after
        assert "replica 2" not in after
        assert await store.lease_holder() == "ctl"
    finally:
        leader.stop()
        for record in (await store.replicas("svc")).values():
            with contextlib.suppress(ProcessLookupError, KeyError):
                os.killpg(pid_of(record), signal.SIGKILL)


@pytest.mark.timeout(120)
async def test_a_resumed_leader_s_next_commit_is_refused(
    controllers: list[ControllerProcess],
    redis_server: EmbeddedRedis,
    redis_prefix: str,
    store: Store,
    tmp_path: Path,
) -> None:
    """As above, with a successor of another name, and the resumed leader's lease
    renewals lost on the way to Redis (a partition that spares its other traffic): what
    stops it is its next commit, refused by the fence."""
    assert redis_server.port is not None
    with FaultProxy(redis_server.port) as proxy:
        argv = controller_argv(proxy.url, redis_prefix, tmp_path / "state", "ctl", ttl=6)
        leader = ControllerProcess(tmp_path / "leader.log", argv)
        controllers.append(leader)
        await ops.up(store, "svc", make_spec(1))
        await ready_view(store, "svc", 1)
        before = await store.replicas("svc")
        replica_pid = pid_of(before[1])
        try:
            leader.proc.send_signal(signal.SIGSTOP)
            await until(lease_expired(store), timeout=30, what="the lease to expire")
            assert await store.lease("successor", 60).acquire()
            proxy.drop_commands(b"EVALSHA")  # the lease scripts: renewal never answers
            os.killpg(replica_pid, signal.SIGKILL)
            await until(lambda: not running(replica_pid), what="the replica to die")
            await store.nudge("svc")
            resumed_at = len(leader.text())
            leader.proc.send_signal(signal.SIGCONT)

            await stepped_down(leader, resumed_at)
            after = leader.text()[resumed_at:]
            assert "commit refused: the leader lease is successor's" in after, after
            assert await store.replicas("svc") == before, after
            assert "replica 2" not in after
            assert await store.lease_holder() == "successor"
        finally:
            leader.stop()
            for record in (await store.replicas("svc")).values():
                with contextlib.suppress(ProcessLookupError, KeyError):
                    os.killpg(pid_of(record), signal.SIGKILL)


# -- the store's fence, in process ---------------------------------------------------------


async def test_a_fenced_commit_is_refused_when_another_holds_the_lease(
    store: Store, redis_client: redis.asyncio.Redis, redis_prefix: str
) -> None:
    fenced = Store(redis_client, prefix=redis_prefix, fence="me:1")
    await store.register_service(ServiceRecord(name="svc"), b"{}")
    generation = await store.generation("svc")
    replica = ReplicaRecord(id=1, status=ReplicaStatus.STARTING, url="http://127.0.0.1:9")

    with pytest.raises(LeaseLost):  # nobody holds it
        await fenced.commit("svc", replica_updates=[replica])
    assert await store.lease("other", 30).acquire()
    with pytest.raises(LeaseLost):  # another holds it
        await fenced.commit("svc", replica_updates=[replica])
    assert await store.replicas("svc") == {}
    assert await store.generation("svc") == generation

    assert await store.lease("other", 30).release()
    assert await store.lease("me:1", 30).acquire()
    await fenced.commit("svc", replica_updates=[replica])  # the holder commits
    assert list(await store.replicas("svc")) == [1]


async def test_a_lease_taken_between_read_and_exec_aborts_the_commit(
    store: Store, redis_client: redis.asyncio.Redis, redis_prefix: str, redis_url: str
) -> None:
    fenced = Store(redis_client, prefix=redis_prefix, fence="me:1")
    await store.register_service(ServiceRecord(name="svc"), b"{}")
    assert await store.lease("me:1", 30).acquire()
    thief = redis.Redis.from_url(redis_url)
    plans = 0

    def plan(current: ServiceRecord, replicas: dict[int, ReplicaRecord]) -> tuple[Mutation, None]:
        nonlocal plans
        plans += 1
        # After the fenced store read the lease (its own) and before its EXEC: a
        # successor takes the lease over (its holder expired and another acquired it).
        thief.set(store.keys.leader, "successor")
        replica = ReplicaRecord(id=1, status=ReplicaStatus.STARTING, url="http://127.0.0.1:9")
        return Mutation(replica_updates=(replica,)), None

    try:
        with pytest.raises(LeaseLost, match="successor"):
            await fenced.commit_with("svc", plan)
    finally:
        thief.close()
    assert plans == 1
    assert await store.replicas("svc") == {}


async def test_a_controller_step_without_the_lease_launches_nothing(
    store: Store, redis_client: redis.asyncio.Redis, redis_prefix: str, redis_url: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    config = ControllerConfig(
        redis_url=redis_url, prefix=redis_prefix, state_dir=tmp_path / "state",
        reconcile_interval=30.0, terminate_on_exit=True,
    )  # fmt: skip
    fenced = Store(redis_client, prefix=redis_prefix, fence="me:1")
    await ops.up(store, "svc", make_spec(2))
    assert await store.lease("successor", 30).acquire()
    async with Controller(fenced, config) as controller:
        with pytest.raises(LeaseLost):
            await controller.step()
        assert await store.replicas("svc") == {}
    assert not list((tmp_path / "state").glob("svc/replica-*"))


@pytest.mark.parametrize("lease", ["expired", "taken"])
async def test_terminate_on_exit_needs_the_lease_to_be_ours_or_free(
    lease: str,
    store: Store,
    redis_client: redis.asyncio.Redis,
    redis_prefix: str,
    redis_url: str,
    tmp_path: Path,
) -> None:
    config = ControllerConfig(
        redis_url=redis_url, prefix=redis_prefix, state_dir=tmp_path / "state",
        reconcile_interval=30.0, term_timeout=3.0, terminate_on_exit=True, lease_ttl=60.0,
    )  # fmt: skip
    fenced = Store(redis_client, prefix=redis_prefix, fence="me:1")
    assert await store.lease("me:1", 60).acquire()
    controller = Controller(fenced, config)
    await controller.start()
    runner = asyncio.create_task(controller.run())
    pids: list[int] = []
    try:
        await ops.up(store, "svc", make_spec(1))
        await ready_view(store, "svc", 1)
        pids = [pid_of(r) for r in (await store.replicas("svc")).values()]
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        # The lease ran out while shutting down (a slow exit), or a successor took it.
        await redis_client.delete(store.keys.leader)
        if lease == "taken":
            assert await store.lease("successor", 60).acquire()
        await controller.aclose()
        if lease == "expired":  # nobody else leads: stopped, records deleted
            assert not [pid for pid in pids if running(pid)]
            assert await store.replicas("svc") == {}
        else:  # the successor's fleet now: untouched
            assert all(running(pid) for pid in pids)
            assert list(await store.replicas("svc")) == [1]
    finally:
        runner.cancel()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
