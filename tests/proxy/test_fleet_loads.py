"""The fleet's in-flight counts on the placement channel (`--fleet-load`,
proxy/sources/placement.py): each proxy announces its own counts per replica, every
other proxy sets `peer_inflight` to their sum within about 100 ms, never counting its
own, never a proxy twice (the in-flight hash's second-old entry of a proxy heard on the
channel is left out), and forgets a proxy gone quiet; the cold prompts computing
(`prefilling`, `p` lines) likewise into `peer_prefilling`. Hostile lines are skipped and
counted. Real redis-server, real RedisSources and ReadySets in this process; other
proxies' lines are published as another proxy user would."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from zlib import crc32

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from controlplane.store import Store
from proxy.config import ProxyConfig
from proxy.metrics import render
from proxy.readyset import ReadySet
from proxy.sources.placement import (
    COLD,
    LOAD_FRESH,
    LOAD_INTERVAL,
    LOAD_REFRESH,
    MAX_LOAD,
    MAX_LOAD_PEERS,
    PlacementSync,
    parse_lines,
)
from proxy.sources.redis import RedisSource
from proxy.stats import Stats
from proxy.wire.engines import EngineStats, EngineView
from proxy.wire.keys import Keys
from proxy.wire.snapshot import PrefixOptions
from tests.proxy.test_peer_inflight import entry
from tests.proxy.test_prefix import URLS, snapshot
from tests.support.builders import registered, replica
from tests.support.poll import until

Proxy = tuple[RedisSource, ReadySet, Stats]


async def start(redis_url: str, redis_prefix: str, proxy_id: str, flush: float,
                fleet_load: str = "on") -> Proxy:
    config = ProxyConfig(redis_url=redis_url, service="svc", redis_prefix=redis_prefix,
                         proxy_id=proxy_id, fleet_load=fleet_load, policy="prefix")  # fmt: skip
    stats = Stats()
    ready_set = ReadySet(policy_override="prefix")
    source = RedisSource(config, stats, flush_interval=flush, backoff_max=0.1)
    await source.start(ready_set)
    await until(lambda: len(ready_set.replicas) == 2, what="the proxy to load the set")
    return source, ready_set, stats


@pytest.fixture(params=[60.0])
async def two(request: pytest.FixtureRequest, store: Store, redis_url: str,
              redis_prefix: str) -> AsyncIterator[list[Proxy]]:
    """Two proxies; their in-flight hash flushed every `param` seconds (60 by default:
    never within a test, so what one hears of the other came on the channel)."""
    await registered(store, spec=b"{}")
    await store.commit("svc", replica_updates=[replica(1), replica(2)])
    proxies = [await start(redis_url, redis_prefix, f"proxy-{n}:1", request.param)
               for n in "ab"]
    yield proxies
    for source, ready_set, _ in proxies:
        await source.aclose()
        ready_set.close()


async def test_auto_counts_the_fleet_while_the_engine_view_names_batching_engines_only(
    store: Store, redis_url: str, redis_prefix: str
) -> None:
    """--fleet-load auto follows the controller's engine view: no view, the
    other proxy's count is seen (the in-flight hash) but not in the bound; a view of vLLM
    engines turns the channel's counts on and the whole spill margin (the loads are the
    fleet's); one llama.cpp server in it turns both off again."""
    await registered(store, spec=b"{}")
    await store.commit("svc", replica_updates=[replica(1), replica(2)])
    proxies = [await start(redis_url, redis_prefix, f"proxy-{n}:1", 0.05, fleet_load="auto")
               for n in "ab"]
    (_, a, _), (_, b, b_stats) = proxies
    one, two_ = sorted(a.replicas, key=lambda r: r.url)
    heard = sorted(b.replicas, key=lambda r: r.url)[0]

    def margin() -> int:
        return b.policy.spill_margin  # type: ignore[attr-defined, no-any-return]

    async def view(*engines: str) -> None:
        await store.telemetry.write_engines({"svc": EngineView(replicas={
            str(n): EngineStats(url=r.url, engine=e)
            for n, (r, e) in enumerate(zip((one, two_), engines, strict=True), 1)})},
            ttl=30)  # fmt: skip

    try:
        # What b applies while it hears no other proxy: the whole margin (no family placed,
        # so the caches are empty). Not read off b here: with a flush every 50 ms b may
        # already have read a's entry in the in-flight hash (a loaded CI run did).
        alone = PrefixOptions().spill_margin
        one.inflight = 3
        # Two flushes (a's write, b's read); 30 s for a loaded CI.
        await until(lambda: heard.peer_seen == 3, timeout=30,
                    what="b to see a's count in the in-flight hash")  # fmt: skip
        await until(lambda: margin() < alone, timeout=30,
                    what="b to share the margin (apply less than the whole)")
        assert heard.peer_inflight == 0 and b_stats.fleet_load == 0  # no engine view: off
        await view("vllm", "unknown")  # a record of no known engine is left out
        await until(lambda: peers(b) == {1: 3, 2: 0} and margin() == alone, timeout=30,
                    what="b to count a's requests in the bound")  # fmt: skip
        assert b"sluice_fleet_load 1.0" in render(b, b_stats, worker=0)
        one.inflight = 5
        await until(lambda: peers(b)[1] == 5, what="the channel's counts (100 ms)")
        await view("vllm", "llamacpp")
        await until(lambda: peers(b) == {1: 0, 2: 0} and margin() < alone, timeout=30,
                    what="b to judge its own counts again")  # fmt: skip
        assert heard.peer_seen == 5  # still seen, for a spill's order
        assert b"sluice_fleet_load 0.0" in render(b, b_stats, worker=0)
    finally:
        one.inflight = 0
        for source, ready_set, _ in proxies:
            await source.aclose()
            ready_set.close()


def listener(two: list[Proxy], redis_prefix: str) -> tuple[ReadySet, Stats, Keys, str]:
    """The second proxy (the one that hears), its stats, the keys, its first replica URL."""
    _, ready_set, stats = two[1]
    return ready_set, stats, Keys(redis_prefix), min(r.url for r in ready_set.replicas)


def peers(ready_set: ReadySet, cold: bool = False) -> dict[int, int]:
    """replica -> peer_inflight (`cold`: peer_prefilling), numbered from 1 in URL order."""
    known = sorted(ready_set.known.values(), key=lambda r: r.url)
    return {n: r.peer_prefilling if cold else r.peer_inflight for n, r in enumerate(known, 1)}


async def test_a_proxys_counts_reach_the_other_and_never_itself(two: list[Proxy]) -> None:
    (_, a, _), (_, b, _) = two
    one, two_ = sorted(a.replicas, key=lambda r: r.url)
    one.inflight, two_.inflight = 3, 1
    await until(lambda: peers(b) == {1: 3, 2: 1}, what="b to hear a's counts")
    one.inflight = 5
    await until(lambda: peers(b) == {1: 5, 2: 1}, what="b to hear a's change")
    # a heard both its own messages too (the channel sends them back): never counted.
    assert peers(a) == {1: 0, 2: 0}
    one.inflight = two_.inflight = 0
    await until(lambda: peers(b) == {1: 0, 2: 0}, what="b to hear a's counts drop to 0")


async def test_a_proxys_cold_prompts_reach_the_other_and_never_itself(
    two: list[Proxy]
) -> None:
    (_, a, _), (_, b, _) = two
    one, two_ = sorted(a.replicas, key=lambda r: r.url)
    one.inflight, one.prefilling = 3, 2  # two of its three computing a cold prompt
    await until(lambda: peers(b, cold=True) == {1: 2, 2: 0}, what="b to hear a's cold prompts")
    await until(lambda: peers(b) == {1: 3, 2: 0}, what="b to hear a's count")
    two_.inflight, two_.prefilling = 1, 1
    one.prefilling = 0  # their first bytes came
    await until(lambda: peers(b, cold=True) == {1: 0, 2: 1}, what="b to hear the change")
    assert peers(a, cold=True) == {1: 0, 2: 0}  # its own, back from the channel: not counted
    two_.prefilling = 0
    await until(lambda: peers(b, cold=True) == {1: 0, 2: 0}, what="b to hear them end")


@pytest.mark.parametrize("two", [0.05], indirect=True)  # the hash read every 50 ms
async def test_a_proxy_heard_on_the_channel_is_not_counted_again_from_the_hash(
    two: list[Proxy], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    b, _, keys, url = listener(two, redis_prefix)
    # An older proxy writes only the hash; a new one both, its hash entry a second old.
    await redis_client.hset(keys.inflight("svc"), mapping={
        "old-proxy:1": entry({url: 2}), "new-proxy:1": entry({url: 7})})  # fmt: skip
    await until(lambda: peers(b)[1] == 9, what="b to count both from the hash")
    line = f"l{crc32(b'new-proxy:1'):x} {{now:.3f}} 3 {url}"

    async def heard() -> bool:  # said again each poll, as new-proxy would every second
        await redis_client.publish(keys.placed("svc"), line.format(now=time.time()))
        return peers(b)[1] == 5

    await until(heard, what="b to take new-proxy's count from the channel only")


async def test_hostile_load_lines_are_skipped_and_counted(
    two: list[Proxy], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    b, stats, keys, url = listener(two, redis_prefix)
    now = f"{time.time():.3f}"
    seen = stats.placements_skipped
    await redis_client.publish(keys.placed("svc"), "\n".join([
        f"l1 {now} -3 {url}",
        f"l1 {now} 12345678 {url}",  # more digits than any count
        f"l1 {now} x {url}",
        f"l1 {now} 3",  # no URL
        f"l1 {now} 3 http://127.0.0.1:1",  # not in the set
        f"lzz {now} 3 {url}",
        f"l1 nan 3 {url}",
        f"l123456789 {now} 3 {url}",
        f"p1 {now} -1 {url}",
        f"p1 {now} 1",
        f"p1 {now} 1 http://127.0.0.1:1",
        f"p1 inf 1 {url}",
        f"l2 {now} 4 {url}",  # the good lines
        f"p2 {now} 1 {url}",
    ]).encode())
    await until(lambda: peers(b)[1] == 4, what="the good line")
    await until(lambda: peers(b, cold=True)[1] == 1, what="the good cold line")
    await until(lambda: stats.placements_skipped >= seen + 12, what="the bad lines counted")
    assert peers(b)[2] == 0 and peers(b, cold=True)[2] == 0
    # Never stored: an `l` or `p` field in the hash is hostile, deleted by the scan.
    await redis_client.hset(keys.placement("svc"), mapping={
        "l1": f"{now} 3 {url}", "p1": f"{now} 1 {url}"})  # fmt: skip

    async def gone() -> bool:
        return not await redis_client.hexists(keys.placement("svc"), "l1") and not (
            await redis_client.hexists(keys.placement("svc"), "p1"))

    await until(gone, what="the stored l and p fields deleted")


def sync_for(ready_set: ReadySet) -> PlacementSync:
    return PlacementSync(None, ready_set, Stats(), key="k", channel="c",  # type: ignore[arg-type]
                         proxy_id="me:1", loads=True)


def followed() -> ReadySet:
    ready_set = ReadySet(policy_override="prefix")
    ready_set.apply(snapshot(1, *URLS[:2]))
    return ready_set


def test_a_proxy_gone_quiet_is_forgotten_and_the_hash_counts_it_again() -> None:
    ready_set = followed()
    sync = sync_for(ready_set)
    one, two = URLS[:2]
    sync.hear_loads([(7, one, 4), (8, one, 1), (8, two, 2)], 100.0)
    assert peers(ready_set) == {1: 5, 2: 2}
    sync.hear_loads([(8, one, 3)], 100.0 + LOAD_FRESH)  # proxy 8 is still talking
    sync.expire_loads(100.0 + LOAD_FRESH + 0.1)
    assert peers(ready_set) == {1: 3, 2: 0}
    assert set(sync.heard_from) == {8}
    sync.set_base({one: 2})  # e.g. proxy 7's hash entry, now it is not heard
    assert peers(ready_set) == {1: 5, 2: 0}
    sync.hear_loads([(8, two, 1)], 100.0 + LOAD_FRESH, COLD)
    assert peers(ready_set, cold=True) == {1: 0, 2: 1}
    sync.expire_loads(100.0 + 2 * LOAD_FRESH + 0.1)  # proxy 8 quiet now too
    assert peers(ready_set, cold=True) == {1: 0, 2: 0}
    sync.hear_loads([(8, two, 1)], 200.0, COLD)
    sync.forget_loads()  # the channel is lost
    assert peers(ready_set) == {1: 2, 2: 0} and peers(ready_set, cold=True) == {1: 0, 2: 0}
    ready_set.close()


def test_one_replica_counts_at_most_max_load_peers_proxies_and_clamps() -> None:
    ready_set = followed()
    sync = sync_for(ready_set)
    one = URLS[0]
    skipped = sync.hear_loads([(p, one, 1) for p in range(1, MAX_LOAD_PEERS + 3)], 1.0)
    assert skipped == 2
    assert peers(ready_set)[1] == MAX_LOAD_PEERS
    sync.hear_loads([(1, one, MAX_LOAD)], 1.0)
    assert peers(ready_set)[1] == MAX_LOAD
    ready_set.close()


@given(st.sampled_from([b"l", b"p"]), st.binary(max_size=300))
def test_any_message_parses_to_bounded_counts(kind: bytes, payload: bytes) -> None:
    lines = parse_lines(kind + b"1 1.5 " + payload)
    for proxy, url, n in lines.loads + lines.colds:
        assert 0 <= n <= MAX_LOAD and url and 0 <= proxy < 1 << 32


@given(st.integers(0, 10**7 - 1), st.sampled_from(URLS))
def test_a_count_round_trips(n: int, url: str) -> None:
    lines = parse_lines(f"lff 1.5 {n} {url}\npff 1.5 {n} {url}".encode())
    assert lines.loads == lines.colds == [(0xFF, url, min(n, MAX_LOAD))]
    assert not lines.skipped


class Announcer:
    """A PlacementSync with a clock of its own on a real redis-server, ticked by hand;
    `announced(at)` ticks at `at` and returns this proxy's in-flight counts for `one` that
    the tick published, read off the channel up to a marker published after it."""

    def __init__(self, client: aioredis.Redis, redis_prefix: str) -> None:
        self.client = client
        self.channel = f"{redis_prefix}test-loads"
        self.now = 100.0
        self.ready_set = followed()
        self.sync = PlacementSync(client, self.ready_set, Stats(), key=f"{redis_prefix}k",
                                  channel=self.channel, proxy_id="me:1", loads=True,
                                  clock=lambda: self.now)  # fmt: skip
        self.one = min(self.ready_set.replicas, key=lambda r: r.url)
        self.pubsub = client.pubsub()

    async def __aenter__(self) -> Announcer:
        await self.pubsub.subscribe(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pubsub.aclose()
        self.ready_set.close()

    async def announced(self, at: float) -> list[int]:
        self.now = at
        await self.sync.tick()
        await self.client.publish(self.channel, b"marker")
        counts: list[int] = []
        deadline = time.monotonic() + 30
        while True:
            # None: nothing yet, or the subscription's confirmation (skipped)
            msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            assert time.monotonic() < deadline, "the marker never came back"
            if msg is None:
                continue
            if msg["data"] == b"marker":
                return counts
            lines = parse_lines(msg["data"])
            counts += [n for _, url, n in lines.loads if url == self.one.url]


async def test_a_count_that_stands_still_is_announced_again_every_second(
    redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    """Long streams hold a replica's count still: never a changed count, so only the full
    announcement every LOAD_REFRESH keeps it alive at the others (who drop a count unheard
    for LOAD_FRESH). That one goes out whether or not the changed counts are due."""
    async with Announcer(redis_client, redis_prefix) as a:
        a.one.inflight = 3
        assert await a.announced(100.0) == [3]  # the first tick: everything
        a.one.inflight = 2
        late = 100.0 + LOAD_REFRESH - LOAD_INTERVAL / 2
        assert await a.announced(late) == [2]  # due; the next not before the full one
        assert await a.announced(late + 0.02) == []  # not due, not full
        assert await a.announced(100.0 + LOAD_REFRESH) == [2]  # the full one, not due
        a.one.inflight = 0
