"""Ambiguous commits: the connection drops right after EXEC was applied (a fault-injecting
TCP proxy between the client and a real redis-server cuts it before the reply comes
back). redis-py then raises WatchError; the retry must see that the transaction was
applied instead of applying it again."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from controlplane import ops
from controlplane.cli import cli
from controlplane.reconcile import Controller, ControllerConfig
from controlplane.redisserver import EmbeddedRedis
from controlplane.servicespec import ServiceSpec, load_spec
from controlplane.store import Store
from tests.support.builders import make_spec, ready_view
from tests.support.faultproxy import FaultProxy
from tests.support.processes import REPO

ECHO = REPO / "examples" / "echo.yaml"


@pytest.fixture
def fault_proxy(redis_server: EmbeddedRedis) -> Iterator[FaultProxy]:
    assert redis_server.port is not None
    with FaultProxy(redis_server.port) as proxy:
        yield proxy


def echo_spec() -> ServiceSpec:
    return load_spec(ECHO)


async def test_update_cut_after_exec_bumps_the_version_once(
    fault_proxy: FaultProxy, store: Store, redis_prefix: str
) -> None:
    await ops.up(store, "svc", echo_spec())
    async with Store.from_url(fault_proxy.url, prefix=redis_prefix) as flaky:
        fault_proxy.cut_after_exec(1)
        version = await ops.update(flaky, "svc", echo_spec())
    assert fault_proxy.cut == 1  # the EXEC was applied and its reply lost
    record = await store.service("svc")
    assert record is not None
    assert (version, record.version) == (2, 2)
    assert await store.spec("svc", 3) is None


async def test_up_cut_after_exec_succeeds_once(
    fault_proxy: FaultProxy, store: Store, redis_prefix: str
) -> None:
    async with Store.from_url(fault_proxy.url, prefix=redis_prefix) as flaky:
        fault_proxy.cut_after_exec(1)
        record = await ops.up(flaky, "svc", echo_spec())  # no ServiceExists
    assert fault_proxy.cut == 1
    assert record.version == 1
    assert await store.services() == ["svc"]


async def test_add_replica_cut_after_exec_adds_one_replica(
    fault_proxy: FaultProxy, store: Store, redis_prefix: str
) -> None:
    await ops.up(store, "svc", echo_spec())
    async with Store.from_url(fault_proxy.url, prefix=redis_prefix) as flaky:
        fault_proxy.cut_after_exec(1)
        replica_id = await ops.add_replica(flaky, "svc", "http://127.0.0.1:9")
    assert fault_proxy.cut == 1
    assert list(await store.replicas("svc")) == [replica_id]


def test_cli_update_and_up_through_a_connection_cut_after_exec(
    fault_proxy: FaultProxy, redis_prefix: str, redis_url: str, tmp_path: Path
) -> None:
    args = ["--redis", fault_proxy.url, "--prefix", redis_prefix,
            "--state-dir", str(tmp_path / "st")]  # fmt: skip
    runner = CliRunner()
    fault_proxy.cut_after_exec(1)
    result = runner.invoke(cli, ["up", str(ECHO), "-n", "echo", *args])
    assert result.exit_code == 0, result.output
    assert "already exists" not in result.output
    fault_proxy.cut_after_exec(1)
    result = runner.invoke(cli, ["update", "echo", str(ECHO), *args])
    assert result.exit_code == 0, result.output
    assert "version 2" in result.stdout
    assert fault_proxy.cut == 2
    direct = ["--redis", redis_url, *args[2:]]
    result = runner.invoke(cli, ["status", "echo", "--json", *direct])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["version"] == 2


async def test_a_controller_commit_cut_after_exec_launches_once(
    fault_proxy: FaultProxy, store: Store, redis_prefix: str, redis_url: str, tmp_path: Path
) -> None:
    config = ControllerConfig(
        redis_url=redis_url, prefix=redis_prefix, state_dir=tmp_path / "state",
        drain_seconds=0.0, reconcile_interval=30.0, term_timeout=3.0, terminate_on_exit=True,
    )  # fmt: skip
    async with Store.from_url(fault_proxy.url, prefix=redis_prefix) as flaky:
        controller = Controller(flaky, config)
        # The commit that records the new replica (PROVISIONING) loses its reply.
        fault_proxy.cut_after_exec(1, containing=b"PROVISIONING")
        await ops.up(store, "svc", make_spec(1))
        await controller.start()
        runner = asyncio.create_task(controller.run())
        try:
            await ready_view(store, "svc", 1)
        finally:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
            await controller.aclose()
    assert fault_proxy.cut == 1
    events = await store.events("svc", count=1000)
    assert [e.fields.get("replica") for e in events if e.kind == "launch"] == ["1"]
    assert not [e for e in events if e.kind == "terminate"], events
