"""The control plane through a `redis+sentinel://` URL: the store (commits, the lease),
the CLI commands, and `sluice-proxy`'s option, against real sentinels.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from click.testing import CliRunner

from controlplane.cli import cli
from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store, StoreUnavailable
from proxy.cli import proxy_command
from tests.support.poll import retrying
from tests.support.processes import REPO
from tests.support.sentinel import SentinelGroup

pytestmark = pytest.mark.slow
ECHO = REPO / "examples" / "echo.yaml"


@pytest.mark.parametrize("how", ["sentinel-failover", "sigkill"])
async def test_commits_and_the_lease_continue_on_the_new_primary(
    sentinel_factory: Callable[..., SentinelGroup], redis_prefix: str, how: str
) -> None:
    group = sentinel_factory(password="data-pw")
    assert group.url.startswith("redis+sentinel://:data-pw@")
    async with Store.from_url(group.url, prefix=redis_prefix, socket_timeout=2.0) as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")
        ready = ReplicaRecord(id=1, status=ReplicaStatus.READY, url="http://127.0.0.1:23001")
        first = await store.commit("svc", replica_updates=[ready])
        assert await store.lease("leader-a", 30.0).acquire()
        await store._redis.wait(1, 5000)  # the replica has both before the primary goes
        if how == "sigkill":
            await asyncio.to_thread(group.kill_primary)
        else:
            await asyncio.to_thread(group.failover)
        # The lease is held on the new primary: renewed by its holder, refused to others.
        renewed = await retrying(lambda: store.lease("leader-a", 30.0).extend(),
                                 on=(StoreUnavailable,))  # fmt: skip
        assert renewed is True
        assert await store.lease("leader-b", 30.0).acquire() is False
        second = await retrying(lambda: store.commit("svc", replica_updates=[
            ReplicaRecord(id=2, status=ReplicaStatus.READY, url="http://127.0.0.1:23002")]),
            on=(StoreUnavailable,))  # fmt: skip
        assert second.generation == first.generation + 1
        snap = await store.snapshot("svc")
        assert snap is not None and len(snap.replicas) == 2


def test_cli_commands_work_through_a_sentinel_url(
    sentinel_factory: Callable[..., SentinelGroup], redis_prefix: str
) -> None:
    group = sentinel_factory()
    ops = ["--redis", group.url, "--prefix", redis_prefix]
    runner = CliRunner()
    up = runner.invoke(cli, ["up", str(ECHO), "-n", "echo", "-y", *ops],
                       catch_exceptions=False)
    assert up.exit_code == 0, up.output
    added = runner.invoke(cli, ["replica", "add", "echo", "http://127.0.0.1:23009", *ops])
    assert added.exit_code == 0, added.output
    group.failover()
    status = runner.invoke(cli, ["status", "echo", "--json", *ops])
    assert status.exit_code == 0, status.output
    assert json.loads(status.output)[0]["name"] == "echo"
    down = runner.invoke(cli, ["down", "echo", "-y", *ops])
    assert down.exit_code == 0, down.output


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis+sentinel://127.0.0.1/svc", "sentinel '127.0.0.1' is not host:port"),
        ("redis+sentinel://127.0.0.1:26379", "no service name"),
        ("redis+sentinel://127.0.0.1:26379/svc/x", "db 'x' is not a number"),
        ("redis+sentinel:///svc", "no sentinel host:port"),
        ("redis+sentinel://h:1/svc?sentinel_pass=x", "unknown option 'sentinel_pass'"),
        ("http://127.0.0.1:6379", "scheme must be redis://"),
    ],
)
def test_a_bad_url_is_one_error_naming_what_is_wrong(url: str, needle: str) -> None:
    for command, args in ((cli, ["status", "--redis", url]),
                          (cli, ["run", str(ECHO), "--redis", url]),
                          (proxy_command, ["--redis", url, "--service", "svc"])):
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 1, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("Error: --redis: "), lines
        assert needle in lines[0], lines
        assert "Traceback" not in result.output
