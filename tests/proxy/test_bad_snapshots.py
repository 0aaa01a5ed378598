"""Snapshots that pass wire validation (or nearly) but would break the proxy are rejected
whole where snapshots are applied, from every source: the set in force stays, the rejection
is counted (sluice_snapshots_rejected) and logged once; no reconnect loop, no leaked pool
slot, no 504.

Real redis-server, real proxy and replica processes; the Sky Serve controller is the stub.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store
from proxy.readyset import ReadySet
from proxy.wire.errors import SnapshotInvalid
from proxy.wire.snapshot import ReadyReplica, decode_snapshot
from tests.support import rawhttp
from tests.support.builders import snapshot
from tests.support.harness import get_json, metric, scrape
from tests.support.poll import until
from tests.support.ports import HOST, free_port
from tests.support.processes import REPO, Proxy, ProxyFactory, ReplicaFactory
from tests.support.rawhttp import get
from tests.support.skyserve_stub import StubController

GOOD_URL = "http://127.0.0.1:8001"

# name -> the replicas that come next to a good one (id 1) in a snapshot
BAD: dict[str, list[dict[str, Any]]] = {
    "port out of range": [{"id": 2, "url": "http://127.0.0.1:99999"}],
    "non-numeric port": [{"id": 2, "url": "http://127.0.0.1:80a"}],
    "non-ASCII host (latin-1)": [{"id": 2, "url": "http://r\u00e9plique.example:8000"}],
    "non-ASCII host": [{"id": 2, "url": "http://\u0440\u0435\u043f\u043b\u0438\u043a\u0430:8000"}],
    "DNS label over 63 bytes": [{"id": 2, "url": f"http://{'a' * 64}.example:8000"}],
    "host over 253 bytes": [{"id": 2, "url": f"http://{'.'.join(['a' * 60] * 5)}:8000"}],
    "unsupported scheme": [{"id": 2, "url": "ftp://127.0.0.1:8000"}],
    "empty host": [{"id": 2, "url": "http://:8000"}],
    "port 0": [{"id": 2, "url": "http://127.0.0.1:0"}],
    "duplicate replica id": [{"id": 1, "url": "http://127.0.0.1:8002"}],
    "duplicate replica url": [{"id": 2, "url": "GOOD"}],
}


def payload(generation: int, good_url: str, extra: list[dict[str, Any]]) -> bytes:
    replicas = [{"id": 1, "url": good_url}] + [
        {**r, "url": good_url if r["url"] == "GOOD" else r["url"]} for r in extra]
    return msgspec.json.encode({"service": "svc", "generation": generation,
                                "published_at": time.time(), "replicas": replicas})


# -- the ready set itself ------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(BAD))
def test_apply_rejects_the_whole_snapshot_and_keeps_the_set(case: str) -> None:
    ready_set = ReadySet()
    assert ready_set.apply(snapshot(1, ReadyReplica(id=1, url=GOOD_URL), service="svc"))
    before = (ready_set.snapshot, ready_set.replicas, dict(ready_set.known))
    # Decoding refuses some (the wire struct's own checks); apply() refuses the rest.
    with pytest.raises(SnapshotInvalid) as err:
        ready_set.apply(decode_snapshot(payload(2, GOOD_URL, BAD[case])))
    assert (ready_set.snapshot, ready_set.replicas, dict(ready_set.known)) == before
    assert str(err.value), case


@pytest.mark.parametrize("margin", [-1, 1 << 21, 2.5, "16", None])
def test_a_bad_spill_margin_is_refused_naming_it(margin: object) -> None:
    raw = msgspec.json.decode(payload(2, GOOD_URL, []))
    raw["prefix_options"] = {"spill_margin": margin}
    with pytest.raises(SnapshotInvalid, match="spill_margin"):
        decode_snapshot(msgspec.json.encode(raw))
    raw["prefix_options"] = {"spill_margin": 0}  # 0: no such bound, a valid value
    assert decode_snapshot(msgspec.json.encode(raw)).prefix_options.spill_margin == 0  # type: ignore[union-attr]


def test_good_urls_are_accepted() -> None:
    ready_set = ReadySet()
    urls = ["http://127.0.0.1:8001", "https://[::1]:8443", "http://replica-1.svc.cluster.local",
            "http://my_host:9000", "https://A.Example.COM.:443", f"http://{'a' * 63}.x:1"]
    assert ready_set.apply(snapshot(1, *urls, service="svc"))
    assert [r.port for r in ready_set.replicas] == [8001, 8443, 80, 9000, 443, 1]
    assert ready_set.replicas[1].host_header == b"[::1]:8443"


# -- through a real redis-server to a real proxy ----------------------------------------------


@pytest.fixture
async def redis_proxy(
    redis_url: str, redis_prefix: str, proxy_factory: ProxyFactory,
    replica_factory: ReplicaFactory,
) -> AsyncIterator[tuple[Proxy, str, int, Store]]:
    [rep] = await replica_factory.astart(1)
    async with Store.from_url(redis_url, prefix=redis_prefix) as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")
        good = await store.commit("svc", replica_updates=[
            ReplicaRecord(id=1, status=ReplicaStatus.READY, url=rep.url)])
        proxy = await proxy_factory.astart(
            "--host", HOST, "--redis", redis_url, "--redis-prefix", redis_prefix,
            "--service", "svc", "--sync-interval", "0.2", "--retry-deadline", "5",
            wait="ready")
        yield proxy, rep.url, good.generation, store


async def test_bad_snapshots_from_redis_are_rejected_and_the_proxy_keeps_serving(
    redis_proxy: tuple[Proxy, str, int, Store], redis_client: aioredis.Redis,
    redis_prefix: str,
) -> None:
    proxy, good_url, good_generation, store = redis_proxy
    key, channel = store.keys.snapshot("svc"), store.keys.ready("svc")
    for n, case in enumerate(sorted(BAD), start=1):
        data = payload(good_generation + n, good_url, BAD[case])
        await redis_client.set(key, data)  # the periodic re-GET sees it too
        await redis_client.publish(channel, data)

        async def rejected(n: int = n) -> bool:
            return metric(await scrape(proxy.admin_url), "sluice_snapshots_rejected_total") >= n

        await until(rejected, timeout=10, what=f"{case}: the rejection counted")
        _, snap = await get_json(f"{proxy.admin_url}/snapshot")
        assert snap["snapshot"]["generation"] == good_generation, case
        for _ in range(4):  # every request answered by the good replica, at once
            resp = await rawhttp.fetch(proxy.port, get("/fast"))
            assert resp.status == 200, (case, resp.status)
    samples = await scrape(proxy.admin_url)
    assert metric(samples, "sluice_snapshots_rejected_total") == len(BAD)
    assert metric(samples, "sluice_source_connected") == 1
    assert metric(samples, "sluice_pool_connections") <= 1  # no slot leaked on a bad host
    # A good commit after all that is applied as usual.
    after = await store.commit("svc", replica_updates=[
        ReplicaRecord(id=2, status=ReplicaStatus.READY, url=f"http://{HOST}:{free_port()}")])

    async def applied() -> bool:
        return (await get_json(f"{proxy.admin_url}/snapshot"))[1]["snapshot"][
            "generation"] == after.generation

    await until(applied, timeout=10, what="the good commit applied")
    out = proxy.output()
    assert out.count("rejected snapshot payload") == len(BAD), out
    assert "reconnecting" not in out, out


# -- the Sky Serve sync and the static list -------------------------------------------------


async def test_a_bad_set_from_the_skyserve_controller_is_rejected_once(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    [rep] = await replica_factory.astart(1)
    stub = StubController(script=[{rep.url: "A100"}])
    await stub.start(free_port())
    try:
        proxy = await proxy_factory.astart("--host", HOST, "--controller-addr", stub.url,
                                           "--sync-interval", "0.2", wait="ready")
        stub.script = [{rep.url: "A100", "http://127.0.0.1:99999": "A100"}]
        await stub.wait_syncs(3)

        async def rejected() -> float:
            return metric(await scrape(proxy.admin_url), "sluice_snapshots_rejected_total")

        assert await until(rejected, what="the rejection counted") == 1
        await stub.wait_syncs(3)  # the same answer again: not counted or logged again
        assert await rejected() == 1
        assert (await rawhttp.fetch(proxy.port, get("/fast"))).status == 200
        _, snap = await get_json(f"{proxy.admin_url}/snapshot")
        assert [r["url"] for r in snap["snapshot"]["replicas"]] == [rep.url]
        assert proxy.output().count("rejected the Sky Serve controller's ready set") == 1
    finally:
        await stub.aclose()


@pytest.mark.parametrize("urls", ["http://127.0.0.1:99999", f"http://{'a' * 64}:80",
                                  "http://127.0.0.1:8001,http://127.0.0.1:8001"])
async def test_a_bad_static_list_is_one_clear_startup_error(urls: str) -> None:
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "proxy.cli", "--replicas", urls, "--host", HOST, "--port", "0",
         "--admin-port", "-1"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Error: --replicas:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
