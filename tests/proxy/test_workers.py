"""`--workers N`: both entry points re-execute their workers correctly, a worker that cannot
start makes the supervisor give up instead of restarting it forever, and SIGTERM stops the
supervisor and its workers within the shutdown grace plus a bound. Real processes.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from proxy.runner import RestartPolicy, worker_argv
from tests.support import rawhttp
from tests.support.harness import BASE_ARGS, metric, scrape
from tests.support.poll import until
from tests.support.ports import HOST, free_port
from tests.support.processes import ProxyFactory, ReplicaFactory
from tests.support.rawhttp import get

BIN = Path(sys.executable).parent
ENTRY_POINTS = {
    "sluice-proxy": [str(BIN / "sluice-proxy")],
    "sluice proxy": [str(BIN / "sluice"), "proxy"],
}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_restart_delay_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff_initial=0.5, backoff_max=4.0)
    assert [policy.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.delay(10_000) == 4.0


def test_worker_argv_is_the_proxy_module_with_the_given_options() -> None:
    argv = worker_argv(["--replicas", "http://127.0.0.1:1", "--workers", "2"], 1)
    assert argv == [sys.executable, "-m", "proxy.cli", "--replicas", "http://127.0.0.1:1",
                    "--workers", "2", "--worker-index", "1"]


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
async def test_two_workers_serve_from_either_entry_point(
    entry: str, proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, replicas=[rep], workers=2,
                                       command=ENTRY_POINTS[entry], startup_timeout=60)
    assert len(proxy.worker_pids()) == 2, proxy.output()
    for _ in range(20):
        resp = await rawhttp.fetch(proxy.port, get("/fast"))
        assert resp.status == 200
    served = [metric(await scrape(url), "sluice_requests_total") for url in proxy.admin_urls]
    assert sum(served) == 20, (served, proxy.output())
    assert "restarting" not in proxy.output()
    proxy.terminate()
    assert await proxy.exited(2 + 5) == 0


async def test_a_worker_that_cannot_start_makes_the_supervisor_give_up(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    # The port is taken by a socket without SO_REUSEPORT: only the workers find out (the
    # supervisor never binds), and each one exits at once.
    [rep] = await replica_factory.astart(1)
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind((HOST, port))
        squatter.listen()
        proxy = await proxy_factory.astart(*BASE_ARGS, "--port", str(port), replicas=[rep],
                                           workers=2, wait="none")
        # Five quick deaths with backoff 0.5+1+2+4 s: ~10 s plus five process starts.
        code = await proxy.exited(120)
    out = proxy.output()
    assert code == 1, out
    assert "giving up" in out, out
    assert proxy.worker_pids() == []


async def test_sigterm_stops_the_supervisor_and_its_busy_workers_in_time(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, "--shutdown-grace", "1", replicas=[rep],
                                       workers=2, startup_timeout=60)
    workers = proxy.worker_pids()
    async with aiohttp.ClientSession() as s:
        async def hang() -> None:
            async with s.get(f"{proxy.url}/hang") as resp:
                await resp.read()

        hung = [asyncio.create_task(hang()) for _ in range(4)]
        await until(lambda: rep.stats()["in_flight"] == 4, what="four hung requests")
        proxy.terminate()
        assert await proxy.exited(1 + 5) == 0
        await asyncio.gather(*hung, return_exceptions=True)
    assert len(workers) == 2
    assert all(gone(pid) for pid in workers)
