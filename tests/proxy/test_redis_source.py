"""proxy.sources.redis.RedisSource against a real redis-server and a real ReadySet."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from controlplane.records import ReplicaRecord
from controlplane.redisserver import EmbeddedRedis
from controlplane.states import ReplicaStatus
from controlplane.store import Store
from proxy.config import ProxyConfig
from proxy.errors import ConfigError
from proxy.readyset import ReadySet
from proxy.sources.redis import (
    RedisSource,
)
from proxy.stats import Stats
from proxy.wire.keys import Keys
from proxy.wire.snapshot import ReadyReplica, ReadySnapshot, encode_snapshot
from tests.support import builders
from tests.support.builders import registered, replica
from tests.support.poll import until


class RecordingReadySet(ReadySet):
    """A real ReadySet that also remembers every snapshot it applied."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[ReadySnapshot] = []

    def apply(self, snapshot: ReadySnapshot, *, reset: bool = False) -> bool:
        applied = super().apply(snapshot, reset=reset)
        if applied:
            self.applied.append(snapshot)
        return applied

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]


class Proxy:
    """One subscribed 'proxy': a RedisSource feeding a RecordingReadySet."""

    def __init__(self, source: RedisSource, ready_set: RecordingReadySet, stats: Stats) -> None:
        self.source = source
        self.ready_set = ready_set
        self.stats = stats

    @property
    def generation(self) -> int:
        return self.ready_set.generation


StartProxy = Callable[..., Any]


@pytest.fixture
async def start_proxy(redis_url: str, redis_prefix: str) -> AsyncIterator[StartProxy]:
    """`await start_proxy(url=..., **RedisSource kwargs)`; every proxy is closed at teardown."""
    proxies: list[Proxy] = []

    async def start(*, url: str = redis_url, service: str = "svc", proxy_id: str | None = None,
                    **kwargs: Any) -> Proxy:
        kwargs.setdefault("backoff_initial", 0.02)
        kwargs.setdefault("backoff_max", 0.2)
        kwargs.setdefault("resync_interval", 60.0)  # tests of the re-GET set it lower
        config = ProxyConfig(redis_url=url, service=service, redis_prefix=redis_prefix,
                             proxy_id=proxy_id)
        stats = Stats()
        ready_set = RecordingReadySet()
        proxy = Proxy(RedisSource(config, stats, **kwargs), ready_set, stats)
        proxies.append(proxy)
        await proxy.source.start(ready_set)
        return proxy

    yield start
    for proxy in proxies:
        await proxy.source.aclose()
        proxy.ready_set.close()


def snapshot(generation: int, *ids: int, service: str = "svc") -> ReadySnapshot:
    """Replicas `ids` at 127.0.0.1 ports 29000 + id (unlike the committed ones)."""
    infos = (ReadyReplica(id=i, url=f"http://127.0.0.1:{29000 + i}") for i in ids)
    return builders.snapshot(generation, *infos, service=service, active_versions=[1])


async def register(store: Store) -> None:
    await registered(store, spec=b"{}")


def test_the_keys_a_proxy_uses_are_the_documented_ones() -> None:
    """The names in docs/redis.md; a change here breaks every deployed proxy."""
    keys = Keys("t1-abc")
    assert keys.snapshot("svc") == "t1-abc:svc:svc:snapshot"
    assert keys.ready("svc") == "t1-abc:svc:svc:ready"
    assert keys.rps("svc") == "t1-abc:svc:svc:rps"
    assert keys.inflight("svc") == "t1-abc:svc:svc:inflight"
    assert keys.proxies("svc") == "t1-abc:svc:svc:proxies"
    assert keys.control == "t1-abc:control"
    assert Keys().prefix == "sluice"


async def test_a_proxy_started_after_the_commit_gets_the_snapshot(
    store: Store, start_proxy: StartProxy
) -> None:
    await register(store)
    snap = await store.commit("svc", replica_updates=[replica(1), replica(2)])
    proxy = await start_proxy()  # start() waits for the first GET
    assert proxy.generation == snap.generation
    assert proxy.ready_set.urls == [r.url for r in snap.replicas]
    assert proxy.source.connected and proxy.stats.source_connected == 1
    assert sum(proxy.stats.propagation.counts) == 0  # the initial load is no propagation


async def test_commits_arrive_by_publish(store: Store, start_proxy: StartProxy) -> None:
    await register(store)
    proxy = await start_proxy()
    assert proxy.generation == 1 and proxy.ready_set.replicas == ()
    for ids in ([1, 2], [1, 2, 3], [2, 3]):
        snap = await store.commit(
            "svc",
            replica_updates=[replica(i) for i in ids],
            replica_deletes=[i for i in (1, 2, 3) if i not in ids],
        )
        await until(lambda s=snap: proxy.generation == s.generation, what="publish")
        assert proxy.ready_set.urls == [r.url for r in snap.replicas]
    assert sum(proxy.stats.propagation.counts) == 3
    assert proxy.stats.propagation.sum < 3.0


async def test_stale_and_duplicate_generations_are_ignored(
    store: Store, start_proxy: StartProxy, redis_client: aioredis.Redis
) -> None:
    await register(store)
    proxy = await start_proxy()
    current = await store.commit("svc", replica_updates=[replica(1), replica(2)])
    await until(lambda: proxy.generation == current.generation)
    channel = store.keys.ready("svc")
    await redis_client.publish(channel, encode_snapshot(snapshot(current.generation - 1, 7)))
    await redis_client.publish(channel, encode_snapshot(snapshot(current.generation, 8)))
    await redis_client.publish(channel, encode_snapshot(snapshot(0)))
    # Messages on a channel arrive in order: once the next commit is in, the three
    # above were seen and dropped.
    after = await store.commit("svc", replica_updates=[replica(3)])
    await until(lambda: proxy.generation == after.generation)
    assert [s.generation for s in proxy.ready_set.applied] == [
        1,
        current.generation,
        after.generation,
    ]
    assert proxy.ready_set.urls == [r.url for r in after.replicas]
    assert proxy.stats.snapshots_rejected == 0


async def test_invalid_payloads_are_rejected_and_the_set_is_kept(
    store: Store, start_proxy: StartProxy, redis_client: aioredis.Redis
) -> None:
    await register(store)
    current = await store.commit("svc", replica_updates=[replica(1), replica(2)])
    proxy = await start_proxy()
    good = proxy.ready_set.urls
    assert len(good) == 2
    newer = current.generation + 10
    valid = encode_snapshot(snapshot(newer, 5))
    bad_payloads = [
        b"garbage",
        b"",
        b'{"service": 5, "generation": "x"}',  # wrong types
        b'{"service": "svc"}',  # required fields missing
        valid[: len(valid) // 2],  # truncated
        valid.replace(b"http://127.0.0.1", b"ftp://127.0.0.1"),  # fails validation
        valid.replace(b"http://127.0.0.1:29005", b"http://"),  # no host: the ReadySet refuses
        encode_snapshot(snapshot(newer, 6, service="other")),  # another service's
    ]
    channel = store.keys.ready("svc")
    for payload in bad_payloads:
        await redis_client.publish(channel, payload)
    await redis_client.publish(channel, b"garbage")  # the same payload again: counted once
    after = await store.commit("svc", replica_updates=[replica(3)])
    await until(lambda: proxy.generation == after.generation)
    assert proxy.stats.snapshots_rejected == len(bad_payloads)
    assert [s.generation for s in proxy.ready_set.applied] == [current.generation, after.generation]
    assert proxy.ready_set.urls == [*good, replica(3).url]


async def test_a_corrupt_stored_snapshot_is_rejected_on_get(
    store: Store, start_proxy: StartProxy, redis_client: aioredis.Redis
) -> None:
    await register(store)
    current = await store.commit("svc", replica_updates=[replica(1)])
    proxy = await start_proxy(resync_interval=0.02)
    await redis_client.set(store.keys.snapshot("svc"), b'{"generation": 99')
    await until(lambda: proxy.stats.snapshots_rejected == 1, what="rejection")
    await until(lambda: proxy.stats.snapshots_rejected == 1, timeout=0.2)  # re-GETs: once
    assert proxy.generation == current.generation and len(proxy.ready_set.replicas) == 1


async def test_a_missed_publish_is_recovered_by_the_periodic_get(
    store: Store, start_proxy: StartProxy, redis_client: aioredis.Redis
) -> None:
    await register(store)
    proxy = await start_proxy(resync_interval=0.05)
    # Written without a PUBLISH, as if the message had been lost.
    await redis_client.set(store.keys.snapshot("svc"), encode_snapshot(snapshot(50, 1, 2)))
    await until(lambda: proxy.generation == 50, what="re-GET")
    assert len(proxy.ready_set.replicas) == 2


async def test_generations_restarting_after_redis_lost_its_data_are_followed(
    store: Store, start_proxy: StartProxy, redis_client: aioredis.Redis
) -> None:
    await register(store)
    proxy = await start_proxy(resync_interval=0.05)
    await redis_client.set(store.keys.snapshot("svc"), encode_snapshot(snapshot(50, 1, 2)))
    await until(lambda: proxy.generation == 50, what="generation 50")
    # Redis comes back empty and the controller starts over: a lower generation is stored.
    await redis_client.set(store.keys.snapshot("svc"), encode_snapshot(snapshot(2, 3)))
    await until(lambda: proxy.generation == 2, what="the restarted generations")
    assert len(proxy.ready_set.replicas) == 1
    # A stale *published* generation is still ignored; commits go on from there.
    await redis_client.publish(store.keys.ready("svc"), encode_snapshot(snapshot(1, 1, 2)))
    await redis_client.set(store.keys.snapshot("svc"), encode_snapshot(snapshot(3, 4, 5)))
    await redis_client.publish(store.keys.ready("svc"), encode_snapshot(snapshot(3, 4, 5)))
    await until(lambda: proxy.generation == 3, what="generation 3")
    assert [a.generation for a in proxy.ready_set.applied][-3:] == [50, 2, 3]


async def test_the_set_survives_a_redis_sigkill_and_catches_up(
    redis_factory: Callable[..., EmbeddedRedis], redis_prefix: str, start_proxy: StartProxy
) -> None:
    server = redis_factory(persist=True)
    async with Store.from_url(server.url, prefix=redis_prefix) as store:
        await register(store)
        before = await store.commit("svc", replica_updates=[replica(1), replica(2)])
        # A backoff long enough that the commit below lands before the reconnection.
        proxy = await start_proxy(url=server.url, backoff_initial=0.4, backoff_max=0.4)
        assert proxy.generation == before.generation

        server.kill()
        await until(lambda: not proxy.source.connected, what="disconnect")
        assert proxy.generation == before.generation
        assert len(proxy.ready_set.replicas) == 2  # still serving the last snapshot

        server.restart()
        # Committed while the proxy is still disconnected (backing off): its PUBLISH
        # goes to nobody; the proxy's GET on reconnect must find it.
        after = await store.commit("svc", replica_updates=[replica(3)])
        await until(lambda: proxy.generation == after.generation, what="catch-up")
        assert proxy.source.connected
        assert proxy.ready_set.urls == [r.url for r in after.replicas]
        assert all(s.replicas for s in proxy.ready_set.applied[1:])  # never emptied


async def test_two_proxies_converge(store: Store, start_proxy: StartProxy) -> None:
    await register(store)
    one, two = await start_proxy(), await start_proxy()
    last = None
    for i in range(60):
        status = ReplicaStatus.READY if i % 2 else ReplicaStatus.NOT_READY
        last = await store.commit("svc", replica_updates=[replica(1), replica(2, status=status)])
    assert last is not None
    await until(lambda: one.generation == two.generation == last.generation)
    assert one.ready_set.snapshot == two.ready_set.snapshot == last


async def test_request_counts_are_flushed_to_the_rps_hash(
    start_proxy: StartProxy, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    proxy = await start_proxy(flush_interval=0.02)
    key = Keys(redis_prefix).rps("svc")
    proxy.stats.requests_total += 5
    await counted(lambda: _hash_total(redis_client, key), 5)
    proxy.stats.requests_total += 3
    await counted(lambda: _hash_total(redis_client, key), 8)
    fields = await redis_client.hkeys(key)
    assert all(abs(int(f) - time.time()) < 60 for f in fields)  # unix seconds
    assert await redis_client.ttl(key) > 0


async def test_each_proxy_heartbeats_the_generation_it_serves(
    store: Store, start_proxy: StartProxy
) -> None:
    await register(store)
    one = await start_proxy(flush_interval=0.02, proxy_id="one")
    two = await start_proxy(flush_interval=0.02, proxy_id="two")
    snaps = [await store.commit("svc", replica_updates=[replica(1), replica(i)])
             for i in range(2, 5)]
    last = snaps[-1].generation
    await until(lambda: one.generation == two.generation == last)
    beats: dict[str, Any] = {}

    async def fresh() -> bool:
        beats.update(await store.telemetry.read_proxies("svc"))
        return len(beats) == 2 and all(b.generation == last for b in beats.values())

    await until(fresh, timeout=5.0, what="both proxies' heartbeats at the last generation")
    assert list(beats) == ["one", "two"]
    for beat, proxy in zip(beats.values(), (one, two), strict=False):
        assert beat.connected
        assert beat.applied_at == pytest.approx(proxy.ready_set.applied_at, abs=5)
        # Every commit this proxy applied is in its recent list, with when it did.
        assert [g for g, _ in beat.recent][-3:] == [s.generation for s in snaps]
        assert all(t >= s.published_at for (_, t), s in zip(beat.recent[-3:], snaps,
                                                                strict=True))
    # A proxy that stopped is pruned once its heartbeat is stale.
    await one.source.aclose()
    assert len(await store.telemetry.read_proxies("svc", stale_after=3600)) == 2
    assert await store.telemetry.read_proxies("svc", stale_after=-1) == {}


async def test_a_failed_flush_keeps_the_count(
    redis_factory: Callable[..., EmbeddedRedis], redis_prefix: str, start_proxy: StartProxy
) -> None:
    server = redis_factory()
    proxy = await start_proxy(url=server.url, flush_interval=0.02)
    server.kill()
    proxy.stats.requests_total += 7
    await until(lambda: proxy.source._flush_failing, what="a failed flush")
    server.restart()  # empty: no persistence
    client = aioredis.Redis.from_url(server.url)
    try:
        key = Keys(redis_prefix).rps("svc")
        await counted(lambda: _hash_total(client, key), 7)
    finally:
        await client.aclose()


async def test_close_flushes_the_last_counts(
    start_proxy: StartProxy, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    proxy = await start_proxy(flush_interval=60.0)
    names = {"sluice-redis-sync", "sluice-rps-flush"}
    assert names <= {t.get_name() for t in asyncio.all_tasks()}
    proxy.stats.requests_total += 4
    await proxy.source.aclose()
    assert await _hash_total(redis_client, Keys(redis_prefix).rps("svc")) == 4
    assert not proxy.source.connected
    assert not names & {t.get_name() for t in asyncio.all_tasks()}  # cancelled and awaited


async def test_password_and_unix_socket_urls(
    redis_factory: Callable[..., EmbeddedRedis], redis_prefix: str, start_proxy: StartProxy
) -> None:
    for server in (
        redis_factory(password="p@ss:w/rd"),
        redis_factory(unix_socket=True, state_dir=None),
    ):
        async with Store.from_url(server.url, prefix=redis_prefix) as store:
            await register(store)
            snap = await store.commit("svc", replica_updates=[replica(1)])
        proxy = await start_proxy(url=server.url)
        assert proxy.generation == snap.generation and proxy.source.connected


@pytest.mark.parametrize("change", ["password", "tls"])
async def test_a_refused_connection_keeps_retrying_without_crashing(
    redis_factory: Callable[..., EmbeddedRedis], start_proxy: StartProxy, change: str
) -> None:
    server = redis_factory(password="right")
    if change == "password":
        url = server.url.replace("right", "wrong")
    else:  # rediss:// to a server without TLS: the handshake fails
        url = server.url.replace("redis://", "rediss://") + "?ssl_cert_reqs=none"
    # (a plain server never answers a TLS hello: the connect timeout ends each attempt)
    proxy = await start_proxy(url=url, start_timeout=0.1, connect_timeout=0.1)
    assert not proxy.source.connected and proxy.generation == -1
    await until(lambda: proxy.source._failures >= 2, what="retries")


async def test_a_bad_url_is_a_config_error(start_proxy: StartProxy) -> None:
    with pytest.raises(ConfigError):
        await start_proxy(url="http://127.0.0.1:1")


async def _hash_total(client: aioredis.Redis, key: str) -> int:
    return sum(int(v) for v in (await client.hgetall(key)).values())


async def counted(read: Callable[[], Awaitable[int]], expected: int) -> None:
    """Poll `read()` until it returns `expected`; it must never overshoot on the way."""

    async def reached() -> bool:
        value = await read()
        assert value <= expected, f"counted {value} > {expected}"
        return value == expected

    await until(reached, timeout=5.0, what=f"the count to reach {expected}")


async def test_inflight_counts_are_published_per_proxy(
    store: Store, start_proxy: StartProxy, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    import json

    await register(store)
    await store.commit("svc", replica_updates=[
        ReplicaRecord(id=1, status=ReplicaStatus.READY, url="http://127.0.0.1:9")])
    proxy = await start_proxy(flush_interval=0.02)
    await until(lambda: proxy.ready_set.replicas, what="the replica")
    proxy.ready_set.replicas[0].inflight = 7  # as if 7 requests were in flight
    key = Keys(redis_prefix).inflight("svc")

    async def total() -> int:
        values = await redis_client.hvals(key)
        return sum(json.loads(v)["total"] for v in values)

    await counted(total, 7)
    entry = json.loads((await redis_client.hvals(key))[0])
    assert entry["replicas"] == {"http://127.0.0.1:9": 7}
    assert abs(entry["at"] - time.time()) < 60
    proxy.ready_set.replicas[0].inflight = 0


async def test_a_held_request_publishes_one_demand_nudge(
    store: Store, start_proxy: StartProxy, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    await register(store)  # no replica: the set is empty
    proxy = await start_proxy()
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(Keys(redis_prefix).control)
    try:
        await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
        for _ in range(3):  # three requests held in a burst: one nudge
            proxy.ready_set.add_waiter(lambda: None)
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
        assert msg is not None and b'"reason":"demand"' in msg["data"]
        assert b'"service":"svc"' in msg["data"]
        assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.3) is None
    finally:
        await pubsub.aclose()
