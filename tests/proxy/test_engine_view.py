"""The proxy's side of engine telemetry: RedisSource reads the published view in its
once-a-second round trip and sets it on each replica; the admin `/metrics` re-exports
it with service and replica labels; a view that is garbage, partly bad, or gone never
touches serving (a real redis-server, a real RedisSource and ReadySet)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import redis.asyncio as aioredis

from controlplane.redisserver import EmbeddedRedis
from controlplane.store import Store
from proxy.config import ProxyConfig
from proxy.metrics import render
from proxy.readyset import ReadySet
from proxy.sources.redis import RedisSource
from proxy.stats import Stats
from proxy.wire.engines import MAX_VIEW_BYTES, EngineStats, EngineView
from proxy.wire.keys import Keys
from tests.support.builders import registered, replica
from tests.support.poll import until


@pytest.fixture(params=[False, True], ids=["default", "engine-load"])
async def followed(
    store: Store, redis_url: str, redis_prefix: str, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[ReadySet, Stats]]:
    await registered(store, spec=b"{}")
    await store.commit("svc", replica_updates=[replica(1), replica(2)])
    config = ProxyConfig(redis_url=redis_url, service="svc", redis_prefix=redis_prefix,
                         engine_load=request.param)  # fmt: skip
    stats, ready_set = Stats(), ReadySet()
    source = RedisSource(config, stats, flush_interval=0.1)
    await source.start(ready_set)
    yield ready_set, stats
    await source.aclose()
    ready_set.close()


def engines(ready_set: ReadySet) -> dict[int, EngineStats | None]:
    return {r.id: r.engine for r in ready_set.known.values()}


async def test_the_view_reaches_the_replicas_and_metrics(
    store: Store, followed: tuple[ReadySet, Stats], request: pytest.FixtureRequest
) -> None:
    ready_set, stats = followed
    one, two = (r.url for r in ready_set.replicas)
    await store.telemetry.write_engines({"svc": EngineView(service="svc", replicas={
        "1": EngineStats(url=one, engine="vllm", at=1.0, running=3, waiting=7, kv_usage=0.5,
                         kv_capacity_tokens=32768, ttft_p50=0.2, ttft_p99=1.5),
        "2": EngineStats(url=two, engine="unknown", at=1.0, error="HTTP 404"),
    })}, ttl=10)  # fmt: skip
    await until(lambda: engines(ready_set)[1] is not None, what="the view to be applied")
    assert engines(ready_set)[1].waiting == 7  # type: ignore[union-attr]
    # Routing counts the engine's queue only with --engine-load.
    queues = {r.id: r.engine_queue for r in ready_set.known.values()}
    engine_load = request.node.callspec.params["followed"]
    assert queues == ({1: 7, 2: 0} if engine_load else {1: 0, 2: 0})
    text = render(ready_set, stats, worker=0).decode()
    labels = f'engine="vllm",replica="{one}",replica_id="1",service="svc"'  # sorted
    assert f"sluice_engine_requests_waiting{{{labels}}} 7.0" in text
    assert f"sluice_engine_requests_running{{{labels}}} 3.0" in text
    assert f"sluice_engine_kv_cache_usage_ratio{{{labels}}} 0.5" in text
    assert (f'sluice_engine_ttft_seconds{{engine="vllm",quantile="0.99",replica="{one}",'
            'replica_id="1",service="svc"} 1.5') in text
    # An unknown engine exports nothing it does not know.
    assert f'replica="{two}"' not in text.split("sluice_engine_requests_waiting")[1].split(
        "# HELP")[0]


async def test_a_bad_view_is_skipped_field_by_field_and_serving_goes_on(
    redis_client: aioredis.Redis, redis_prefix: str, followed: tuple[ReadySet, Stats]
) -> None:
    ready_set, stats = followed
    one, _ = (r.url for r in ready_set.replicas)
    key = Keys(redis_prefix).engines("svc")
    await redis_client.set(key, msgspec.json.encode({"replicas": {
        "1": {"url": one, "waiting": 4, "running": "three", "kv_usage": 9},
        "2": ["junk"],
    }}))  # fmt: skip
    await until(lambda: engines(ready_set)[1] is not None, what="the partial view")
    e = engines(ready_set)[1]
    assert e is not None and (e.waiting, e.running, e.kv_usage) == (4, None, None)
    assert engines(ready_set)[2] is None
    await redis_client.set(key, b"\xff garbage")
    await until(lambda: engines(ready_set)[1] is None, what="garbage to clear the records")
    assert len(ready_set.replicas) == 2 and stats.source_connected == 1
    render(ready_set, stats, worker=0)  # still renders


async def test_the_view_gone_makes_every_replica_unknown(
    store: Store, redis_client: aioredis.Redis, redis_prefix: str,
    followed: tuple[ReadySet, Stats],
) -> None:  # fmt: skip
    ready_set, _ = followed
    one, _ = (r.url for r in ready_set.replicas)
    await store.telemetry.write_engines({"svc": EngineView(replicas={
        "1": EngineStats(url=one, waiting=1)})}, ttl=10)  # fmt: skip
    await until(lambda: engines(ready_set)[1] is not None, what="the view")
    await redis_client.delete(Keys(redis_prefix).engines("svc"))  # as when its TTL ends
    await until(lambda: engines(ready_set)[1] is None, what="the records to clear")


async def test_a_record_for_a_url_not_in_the_set_is_ignored(
    store: Store, followed: tuple[ReadySet, Stats]
) -> None:
    ready_set, _ = followed
    one, _ = (r.url for r in ready_set.replicas)
    await store.telemetry.write_engines({"svc": EngineView(replicas={
        "1": EngineStats(url="http://127.0.0.1:1", waiting=5),
        "2": EngineStats(url=one, waiting=2),  # keyed by another id: the URL decides
    })}, ttl=10)  # fmt: skip
    await until(lambda: engines(ready_set)[1] is not None, what="the view")
    assert engines(ready_set)[1].waiting == 2 and engines(ready_set)[2] is None  # type: ignore[union-attr]


async def test_redis_gone_makes_every_replica_unknown(
    redis_factory: Callable[..., EmbeddedRedis], redis_prefix: str
) -> None:
    """A view that cannot be refreshed is not routed on: when the flush fails, the
    records (and the engine queues policies add) are cleared, and so are the other
    proxies' in-flight counts (--fleet-load): the proxy judges its own."""
    server = redis_factory()
    async with Store.from_url(server.url, prefix=redis_prefix) as store:
        await registered(store, spec=b"{}")
        snap = await store.commit("svc", replica_updates=[replica(1)])
        await store.telemetry.write_engines({"svc": EngineView(replicas={
            "1": EngineStats(url=snap.replicas[0].url, waiting=9)})}, ttl=30)  # fmt: skip
    async with aioredis.from_url(server.url) as client:  # another proxy's entry
        await client.hset(Keys(redis_prefix).inflight("svc"), "peer:1", msgspec.json.encode(
            {"at": time.time(), "replicas": {snap.replicas[0].url: 6}}))  # fmt: skip
    config = ProxyConfig(redis_url=server.url, service="svc", redis_prefix=redis_prefix,
                         engine_load=True, fleet_load="on")  # fmt: skip
    ready_set = ReadySet()
    source = RedisSource(config, Stats(), flush_interval=0.05, backoff_max=0.1)
    await source.start(ready_set)
    try:
        (only,) = ready_set.replicas
        await until(lambda: only.engine_queue == 9 and only.peer_inflight == 6,
                    what="the queue and the peer's count to be counted")  # fmt: skip
        server.kill()
        await until(lambda: only.engine is None and only.engine_queue == 0
                    and only.peer_inflight == 0,
                    what="the records to clear once the flush fails")  # fmt: skip
        assert ready_set.replicas == (only,)  # serving goes on
    finally:
        await source.aclose()
        ready_set.close()


@contextlib.asynccontextmanager
async def connected(redis_url: str, redis_prefix: str) -> AsyncIterator[tuple[ReadySet, Stats]]:
    """A proxy's RedisSource started (its first flush 30 s away), stopped on exit."""
    config = ProxyConfig(redis_url=redis_url, service="svc", redis_prefix=redis_prefix)
    stats, ready_set = Stats(), ReadySet()
    source = RedisSource(config, stats, flush_interval=30.0)
    try:
        await source.start(ready_set)
        yield ready_set, stats
    finally:
        await source.aclose()
        ready_set.close()


async def test_a_proxy_starts_with_the_view_already_published(
    store: Store, redis_url: str, redis_prefix: str
) -> None:
    # Read with the snapshot, not at the first once-a-second flush (here 30 s away): the
    # prefix policy's first placements know the replicas' slots and engine kinds.
    await registered(store, spec=b"{}")
    await store.commit("svc", replica_updates=[replica(1), replica(2)])
    snapshot = await store.snapshot("svc")
    assert snapshot is not None
    urls = [r.url for r in snapshot.replicas]
    await store.telemetry.write_engines({"svc": EngineView(service="svc", replicas={
        str(n): EngineStats(url=url, engine="llamacpp", at=1.0, slots=2)
        for n, url in enumerate(urls, 1)})}, ttl=10)  # fmt: skip
    async with connected(redis_url, redis_prefix) as (ready_set, _):
        assert len(ready_set.replicas) == 2
        got = engines(ready_set)
        assert all(e is not None and e.slots == 2 for e in got.values()), got


@pytest.mark.parametrize("bad", ["garbage", "list", "oversize", "wrong type"])
async def test_a_hostile_view_at_connect_never_stops_the_proxy_loading_its_set(
    store: Store, redis_client: aioredis.Redis, redis_url: str, redis_prefix: str, bad: str
) -> None:
    # The view is read with the snapshot now: whatever is stored under its key, the
    # proxy still loads the set and serves, with every engine unknown.
    await registered(store, spec=b"{}")
    await store.commit("svc", replica_updates=[replica(1), replica(2)])
    key = Keys(redis_prefix).engines("svc")
    if bad == "wrong type":  # GET on a hash: WRONGTYPE
        await redis_client.hset(key, mapping={"1": "x"})
    else:
        await redis_client.set(key, {
            "garbage": b"\xff{not json",
            "list": msgspec.json.encode([{"url": "http://127.0.0.1:1", "slots": 2}]),
            "oversize": b" " * (MAX_VIEW_BYTES + 1),
        }[bad])
    async with connected(redis_url, redis_prefix) as (ready_set, stats):
        assert len(ready_set.replicas) == 2 and stats.source_connected == 1
        assert all(e is None for e in engines(ready_set).values())
