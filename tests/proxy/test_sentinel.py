"""The proxy's Redis source behind Redis Sentinel: real primary, replica and sentinels.

A failover (forced with SENTINEL FAILOVER, or by SIGKILL of the primary) must not
empty the ready set; afterwards the source follows commits made on the new primary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from controlplane.records import ServiceRecord
from controlplane.states import ServiceStatus
from controlplane.store import Store, StoreUnavailable
from proxy.config import ProxyConfig
from proxy.readyset import ReadySet
from proxy.sources.redis import RedisSource
from proxy.stats import Stats
from proxy.wire.snapshot import ReadySnapshot
from tests.support.builders import replica
from tests.support.harness import get_json
from tests.support.poll import retrying, until
from tests.support.processes import ProxyFactory, ReplicaFactory
from tests.support.sentinel import SentinelGroup

pytestmark = pytest.mark.slow


async def commit(store: Store, *ids: int) -> ReadySnapshot:
    """Commit, riding over the connections a failover closes (the controller's loop
    does the same on its next step)."""
    records = [replica(i) for i in ids]
    return await retrying(lambda: store.commit("svc", replica_updates=records),
                          on=(StoreUnavailable,))  # fmt: skip


class Watched:
    """A real ReadySet that records, on every apply, whether it ever went empty."""

    def __init__(self) -> None:
        self.ready_set = ReadySet()
        self.stats = Stats()
        self.emptied = False

    def check(self) -> None:
        if self.ready_set.snapshot is not None and not self.ready_set.replicas:
            self.emptied = True


@pytest.fixture
async def setup(
    sentinel_factory: Callable[..., SentinelGroup], redis_prefix: str
) -> AsyncIterator[tuple[SentinelGroup, Store, RedisSource, Watched]]:
    group = sentinel_factory()
    store = Store.from_url(group.url, prefix=redis_prefix, socket_timeout=2.0)
    await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY), b"{}")
    watched = Watched()
    config = ProxyConfig(redis_url=group.url, service="svc", redis_prefix=redis_prefix)
    # No periodic re-GET: after the failover only the reconnect's GET or a message
    # can bring the proxy up to date.
    source = RedisSource(config, watched.stats, resync_interval=600.0,
                         backoff_initial=0.02, backoff_max=0.2)
    await source.start(watched.ready_set)
    try:
        yield group, store, source, watched
    finally:
        await source.aclose()
        watched.ready_set.close()
        await store.aclose()


async def _fail_over(group: SentinelGroup, how: str, watched: Watched) -> int:
    """Run the (blocking) failover in a thread while checking the set stays non-empty."""
    task: asyncio.Future[Any] = asyncio.ensure_future(asyncio.to_thread(
        group.failover if how == "sentinel-failover" else group.kill_primary))
    while not task.done():
        watched.check()
        await asyncio.sleep(0.01)
    port: int = task.result()
    return port


@pytest.mark.parametrize("how", ["sentinel-failover", "sigkill"])
async def test_proxy_keeps_serving_and_follows_the_new_primary(
    setup: tuple[SentinelGroup, Store, RedisSource, Watched], how: str
) -> None:
    group, store, source, watched = setup
    first = await commit(store, 1, 2)
    await until(lambda: watched.ready_set.generation == first.generation,
                     what="the first snapshot")
    old_port = group.primary_port()

    new_port = await _fail_over(group, how, watched)

    assert new_port != old_port
    assert not watched.emptied
    assert [r.url for r in watched.ready_set.replicas] == [replica(1).url, replica(2).url]
    second = await commit(store, 1, 2, 3)  # on the new primary
    await until(lambda: watched.ready_set.generation == second.generation,
                     timeout=30.0, what="the commit made on the new primary")
    assert len(watched.ready_set.replicas) == 3
    await until(lambda: source.connected, what="the source reconnected")
    third = await commit(store, 1, 3)  # and it follows by subscription from then on
    await until(lambda: watched.ready_set.generation == third.generation,
                     timeout=30.0, what="a second commit on the new primary")


async def test_a_commit_missed_while_reconnecting_is_read_after_the_reconnect(
    sentinel_factory: Callable[..., SentinelGroup], redis_prefix: str
) -> None:
    group = sentinel_factory()
    async with Store.from_url(group.url, prefix=redis_prefix, socket_timeout=2.0) as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")
        first = await commit(store, 1)
        watched = Watched()
        config = ProxyConfig(redis_url=group.url, service="svc", redis_prefix=redis_prefix)
        # A long backoff (2.5-5 s after the first failure) and no periodic re-GET: the
        # commit below lands while the source is disconnected, and only the GET after
        # its reconnect can deliver it.
        source = RedisSource(config, watched.stats, resync_interval=600.0,
                             backoff_initial=5.0, backoff_max=5.0)
        await source.start(watched.ready_set)
        try:
            await until(lambda: watched.ready_set.generation == first.generation)
            # The sentinels close the demoted primary's clients: the source's too.
            await asyncio.to_thread(group.failover)
            await until(lambda: not source.connected, what="the source to disconnect")
            missed = await commit(store, 1, 2)
            assert not source.connected  # published while nobody of ours was subscribed
            await until(lambda: watched.ready_set.generation == missed.generation,
                             timeout=30.0, what="the missed commit")
            assert len(watched.ready_set.replicas) == 2
        finally:
            await source.aclose()
            watched.ready_set.close()


async def test_a_real_proxy_answers_every_request_through_a_failover(
    sentinel_factory: Callable[..., SentinelGroup], redis_prefix: str,
    replica_factory: ReplicaFactory, proxy_factory: ProxyFactory,
) -> None:
    """sluice-proxy (2 workers) given the sentinel URL: requests sent all through a
    SIGKILL of the primary are answered; afterwards it routes to a replica committed on
    the new primary."""
    group = sentinel_factory()
    one, two = await replica_factory.astart(2)
    async with Store.from_url(group.url, prefix=redis_prefix, socket_timeout=2.0) as store:
        await store.register_service(ServiceRecord(name="svc", status=ServiceStatus.READY),
                                     b"{}")
        first = await commit_urls(store, [one.url])
        proxy = await proxy_factory.astart(
            "--redis", group.url, "--service", "svc", "--redis-prefix", redis_prefix,
            workers=2, wait="health")
        for admin in proxy.admin_urls:
            await until(lambda a=admin: _generation(a), what="the first snapshot")
        statuses: list[int] = []
        failing = asyncio.ensure_future(asyncio.to_thread(group.kill_primary))
        async with aiohttp.ClientSession() as session:
            while not failing.done() or len(statuses) < 20:
                async with session.get(proxy.url + "/health") as resp:
                    statuses.append(resp.status)
            await failing
            assert statuses and all(s == 200 for s in statuses), statuses
            second = await commit_urls(store, [one.url, two.url])
            assert second.generation > first.generation
            for admin in proxy.admin_urls:  # every worker follows the new primary
                await until(lambda a=admin: _generation(a, second.generation), timeout=30,
                            what="the commit made on the new primary")
            seen = set()
            for _ in range(20):
                async with session.get(proxy.url + "/health") as resp:
                    assert resp.status == 200
                    seen.add(resp.headers.get("X-Replica-Id"))
            assert len(seen) == 2


async def commit_urls(store: Store, urls: list[str]) -> ReadySnapshot:
    records = [replica(i, url=url) for i, url in enumerate(urls, start=1)]
    return await retrying(lambda: store.commit("svc", replica_updates=records),
                          on=(StoreUnavailable,))  # fmt: skip


async def _generation(admin_url: str, at_least: int = 1) -> bool:
    try:
        status, body = await get_json(admin_url + "/snapshot")
    except (aiohttp.ClientError, OSError):
        return False
    return status == 200 and body["generation"] >= at_least and body["applied_at"] is not None
