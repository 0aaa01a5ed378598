"""Drop-in mode against a stub Sky Serve controller (tests/support/skyserve_stub.py) with real
replica processes and a real sluice-proxy process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import subprocess
import sys
import textwrap
from collections import Counter

import aiohttp
import pytest

from proxy.sources.skyserve_protocol import parse_sync_reply
from tests.support.poll import until_sync
from tests.support.ports import free_port
from tests.support.processes import https_get
from tests.support.skyserve_stub import threaded_stub_code
from tests.support.tls import write_cert


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as resp:
        await resp.read()
        return resp.status, resp.headers.get("X-Replica-Id", "")


async def _snapshot(proxy: object) -> dict:  # type: ignore[type-arg]
    status, body = proxy.admin_get("/snapshot")  # type: ignore[attr-defined]
    assert status == 200
    return json.loads(body)


def test_parse_sync_reply_shapes() -> None:
    assert parse_sync_reply({"replica_info": {"1.2.3.4:8080": {"gpu_type": "A100"},
                                              "http://h:1": {"gpu_type": "unknown"}}}) == {
        "http://1.2.3.4:8080": "A100", "http://h:1": None}
    assert parse_sync_reply({"ready_replica_urls": ["h:2"]}) == {"http://h:2": None}
    with pytest.raises(ValueError):
        parse_sync_reply({"something": 1})


async def test_routes_as_the_controller_says(stub, replica_factory, proxy_factory) -> None:
    r1, r2, r3 = await replica_factory.astart(3, ids=["a", "b", "c"])
    stub.script = [{r1.url: "A100", r2.url: "unknown"}]
    proxy = await proxy_factory.astart("--controller-addr", stub.url, "--sync-interval", "0.3",
                                       wait="ready")
    async with aiohttp.ClientSession() as session:
        seen = Counter([(await _get(session, proxy.url + "/fast"))[1] for _ in range(20)])
        assert set(seen) == {"a", "b"}
        # The controller changes its mind: only replica c from now on.
        stub.script = [{r3.url: "L4"}]
        await stub.wait_syncs(2)
        seen = Counter([(await _get(session, proxy.url + "/fast"))[1] for _ in range(10)])
        assert seen == {"c": 10}
    snap = await _snapshot(proxy)
    assert [r["accelerator"] for r in snap["snapshot"]["replicas"]] == ["L4"]


async def test_timestamps_once_per_request_even_after_a_failed_sync(
        stub, replica_factory, proxy_factory) -> None:
    (r1,) = await replica_factory.astart(1)
    stub.script = [{r1.url: "unknown"}]
    proxy = await proxy_factory.astart("--controller-addr", stub.url, "--sync-interval", "0.3",
                                       wait="ready")
    async with aiohttp.ClientSession() as session:
        for _ in range(15):
            assert (await _get(session, proxy.url + "/fast"))[0] == 200
        stub.fail = 2  # the next two syncs fail: their timestamps must be resent
        await stub.wait_syncs(2)
        for _ in range(10):
            assert (await _get(session, proxy.url + "/fast"))[0] == 200
        # Served through the failures: the last set was kept.
        await stub.wait_syncs(3)
    assert len(stub.timestamps) == 25
    assert stub.timestamps == sorted(stub.timestamps)


async def test_slow_sync_keeps_the_last_set(stub, replica_factory, proxy_factory) -> None:
    (r1,) = await replica_factory.astart(1)
    stub.script = [{r1.url: "unknown"}]
    proxy = await proxy_factory.astart("--controller-addr", stub.url, "--sync-interval", "0.2",
                                       "--sync-timeout", "0.3", wait="ready")
    stub.delay = 1.0  # every sync now times out on the proxy's side
    await stub.wait_syncs(2)
    async with aiohttp.ClientSession() as session:
        statuses = [(await _get(session, proxy.url + "/fast"))[0] for _ in range(10)]
    assert statuses == [200] * 10
    assert b"sluice_source_connected 0.0" in proxy.admin_get("/metrics")[1]


async def _steady_load(url: str, rate: float, seconds: float) -> Counter[int]:
    """Open-loop load: `rate` GETs per second for `seconds`; statuses (0: client error)."""
    results: Counter[int] = Counter()

    async def one(session: aiohttp.ClientSession) -> None:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=15)) as resp:
                await resp.read()
                results[resp.status] += 1
        except (aiohttp.ClientError, TimeoutError):
            results[0] += 1

    async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tg:
        for _ in range(int(rate * seconds)):
            tg.create_task(one(session))
            await asyncio.sleep(1 / rate)
    return results


async def test_empty_reply_then_replicas_gives_no_client_error(
        stub, replica_factory, proxy_factory) -> None:
    r1, r2 = await replica_factory.astart(2)
    full = {r1.url: "unknown", r2.url: "unknown"}
    stub.script = [full]
    # The empty set would last a whole interval (3 s), longer than the proxy holds a
    # request (2 s): only the quick resync (0.5 s later) keeps every request a 200.
    proxy = await proxy_factory.astart("--controller-addr", stub.url, "--sync-interval", "3",
                                       "--empty-wait", "2", wait="ready")
    load = asyncio.create_task(_steady_load(proxy.url + "/fast", rate=20, seconds=6))
    await stub.wait_syncs(1)
    stub.script = [{}, full]  # one empty answer (Sky Serve's relabel gap), then the set again
    results = await load
    assert stub.script == [full]  # the empty answer was served
    assert set(results) == {200}, results


def test_run_load_balancer_serves_with_tls(tmp_path, replica_factory) -> None:
    (r1,) = replica_factory(1)
    ca, cert_path, key_path = write_cert(tmp_path)
    ctrl_port, lb_port = free_port(), free_port()
    # A tiny synchronous stub controller in the child, so this test needs no event loop.
    script = threaded_stub_code(ctrl_port, r1.url) + textwrap.dedent(f"""
        from types import SimpleNamespace
        from proxy.skyserve import run_load_balancer
        cred = SimpleNamespace(certfile={str(cert_path)!r}, keyfile={str(key_path)!r})
        run_load_balancer('http://127.0.0.1:{ctrl_port}', {lb_port}, 'round_robin', cred,
                          {{'A100': 2.0}}, 30)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)

        def answer() -> tuple[int, bytes] | None:
            with contextlib.suppress(OSError):
                return https_get("127.0.0.1", lb_port, "/fast", ctx)
            assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
            return None

        status, body = until_sync(answer, timeout=15, what="run_load_balancer to serve TLS",
                                  interval=0.1)  # fmt: skip
        assert status == 200 and len(body) == 100
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stderr.close()  # type: ignore[union-attr]
