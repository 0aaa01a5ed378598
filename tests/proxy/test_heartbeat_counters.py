"""The heartbeat a proxy writes every second carries its cumulative counters (responses
by class, cut responses, the prefix policy's routing reasons; proxy/tally.py), and the
routing totals never go down when a replica's per-replica counters are swept. Real
replica, redis-server and sluice-proxy processes."""

from __future__ import annotations

import asyncio

import msgspec
import redis.asyncio as aioredis

from controlplane.records import ReplicaRecord, ServiceRecord
from controlplane.states import ReplicaStatus, ServiceStatus
from controlplane.store import Store
from proxy.tally import RoutedTally, response_classes
from proxy.wire.telemetry import ProxyHeartbeat
from tests.support import rawhttp
from tests.support.harness import metric, scrape
from tests.support.poll import until
from tests.support.ports import HOST
from tests.support.processes import ProxyFactory, ReplicaFactory


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


async def test_the_heartbeat_counts_responses_cuts_and_routing_reasons(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory, redis_url: str,
    redis_prefix: str, redis_client: aioredis.Redis,
) -> None:  # fmt: skip
    one, two = await replica_factory.astart(2)
    async with Store.from_url(redis_url, prefix=redis_prefix) as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")  # fmt: skip
        await store.commit("svc", replica_updates=[
            ReplicaRecord(id=1, status=ReplicaStatus.READY, url=one.url),
            ReplicaRecord(id=2, status=ReplicaStatus.READY, url=two.url)])
        proxy = await proxy_factory.astart(
            "--host", HOST, "--redis", redis_url, "--redis-prefix", redis_prefix,
            "--service", "svc", "--policy", "prefix", "--pool-grace", "0", wait="ready")

        async def beat() -> ProxyHeartbeat | None:
            # None until the proxy's first flush (once a second) has written it.
            raws = list((await redis_client.hgetall(store.keys.proxies("svc"))).values())
            assert len(raws) <= 1, raws
            return msgspec.json.decode(raws[0], type=ProxyHeartbeat) if raws else None

        statuses = [(await rawhttp.fetch(proxy.port, get(path))).status
                    for path in ["/fast"] * 5 + ["/status/404", "/status/503"]]
        assert statuses == [200] * 5 + [404, 503]
        try:
            await rawhttp.fetch(proxy.port, get("/stream_then_die"))
        except asyncio.IncompleteReadError:
            pass  # its head came; its body was cut
        else:
            raise AssertionError("the stream was not cut")

        async def counted() -> ProxyHeartbeat | None:
            b = await beat()
            return b if b and b.cuts == 1 and b.responses.get("5xx") == 1 else None

        first = await until(counted, timeout=10, what="the counts in the heartbeat")
        assert first.responses == {"2xx": 5, "3xx": 0, "4xx": 1, "5xx": 1}  # the cut: not 2xx
        assert set(first.routed) == {"affinity", "spill", "fallback"}
        assert sum(first.routed.values()) == 8  # every request was routed once
        # Replica 2 leaves and is swept: its per-replica series go, the totals stay.
        await store.commit("svc", replica_updates=[
            ReplicaRecord(id=2, status=ReplicaStatus.SHUTTING_DOWN, url=two.url)])

        async def swept() -> bool:
            samples = await scrape(proxy.admin_url)
            return metric(samples, "sluice_routed_total", replica=two.url) == 0 and metric(
                samples, "sluice_routed_total") < sum(first.routed.values())

        swept_before = metric(await scrape(proxy.admin_url), "sluice_routed_total",
                              replica=two.url)  # fmt: skip
        if swept_before:  # replica 2 got some of the 8: its series must go
            await until(swept, timeout=10, what="replica 2's series swept")
        later = await until(lambda: _newer(beat, first), timeout=10, what="a later heartbeat")
        assert sum(later.routed.values()) == 8 and later.routed == first.routed


async def _newer(beat: object, than: ProxyHeartbeat) -> ProxyHeartbeat | None:
    b: ProxyHeartbeat | None = await beat()  # type: ignore[operator]
    return b if b is not None and b.seen_at > than.seen_at + 1.5 else None


class _Policy:
    def __init__(self) -> None:
        self.routed: dict[str, list[int]] = {}


def test_routed_totals_survive_sweeps_and_new_policies() -> None:
    tally = RoutedTally()
    policy = _Policy()
    assert tally.read(object()) == {}  # a policy that counts nothing
    policy.routed = {"a": [3, 1, 0], "b": [2, 0, 5]}
    assert tally.read(policy) == {"affinity": 5, "spill": 1, "fallback": 5}
    del policy.routed["b"]  # swept
    policy.routed["a"][0] += 1
    assert tally.read(policy) == {"affinity": 6, "spill": 1, "fallback": 5}
    fresh = _Policy()  # a snapshot changed the policy: it counts from 0
    fresh.routed = {"a": [1, 0, 0]}
    assert tally.read(fresh) == {"affinity": 7, "spill": 1, "fallback": 5}
    assert response_classes({200: 3, 204: 1, 499: 2, 502: 1, 101: 9}) == {
        "2xx": 4, "3xx": 0, "4xx": 2, "5xx": 1}
