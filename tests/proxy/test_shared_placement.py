"""Shared placement of prompt families (proxy/sources/placement.py) on a real
redis-server: two proxies (each a real RedisSource, ReadySet and `prefix` policy, in
this process) converge on one replica per family, whoever placed it; a race of two
placements ends on one; hostile entries in the hash or on the channel are skipped,
counted and deleted; Redis gone, routing goes on with the last view. A family's
secondary (its spill replica) likewise: one proxy's spill is where the other spills,
a race of two spills ends on one, a moved overflow is followed, hostile or stale
secondaries and one whose replica left the set are not. A conversation's turn that
spilled on one proxy is where its next turn goes on the other."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from controlplane.redisserver import EmbeddedRedis
from controlplane.states import ReplicaStatus
from controlplane.store import Store
from proxy.config import ProxyConfig
from proxy.placement import WARM_HOLD, PlacementTable
from proxy.readyset import ReadySet
from proxy.sources.redis import RedisSource
from proxy.stats import Stats
from proxy.wire.keys import Keys
from tests.proxy.test_prefix import LONG, Req, bodies, chat, cold_options
from tests.support.builders import registered, replica
from tests.support.poll import until

Proxy = tuple[RedisSource, ReadySet, Stats]


async def start_proxy(url: str, prefix: str) -> Proxy:
    config = ProxyConfig(redis_url=url, service="svc", redis_prefix=prefix, policy="prefix")
    # epsilon 1: (1 + 1) x the mean of 4 replicas is a bound these tests can load a replica
    # past; at the default 3 it is everything in flight, and a known family never spills.
    stats = Stats()
    ready_set = ReadySet(policy_override="prefix", prefix_options=cold_options(epsilon=1.0))
    source = RedisSource(config, stats, flush_interval=0.1, backoff_max=0.1)
    await source.start(ready_set)
    await until(lambda: len(ready_set.replicas) == 4, what="the proxy to load the set")
    # placement: auto (the default) turns capacity placement on once the source shares it.
    await until(lambda: ready_set.policy.placement is not None,  # type: ignore[attr-defined]
                what="the shared placement to be on")  # fmt: skip
    return source, ready_set, stats


@pytest.fixture
async def two(store: Store, redis_url: str, redis_prefix: str) -> AsyncIterator[list[Proxy]]:
    await registered(store, spec=b"{}")
    await store.commit("svc", replica_updates=[replica(i) for i in range(1, 5)])
    proxies = [await start_proxy(redis_url, redis_prefix) for _ in range(2)]
    yield proxies
    for source, ready_set, _ in proxies:
        await source.aclose()
        ready_set.close()


def table(ready_set: ReadySet) -> PlacementTable:
    t = ready_set.policy.placement  # type: ignore[attr-defined]
    assert isinstance(t, PlacementTable)
    return t


def family(ready_set: ReadySet, body: bytes) -> int:
    return ready_set.policy.key_of(Req(body))[0]  # type: ignore[attr-defined]


def primary_url(ready_set: ReadySet, fid: int) -> str | None:
    fam = table(ready_set).families.get(fid)
    return None if fam is None else fam.primary.url


def set_loads(ready_set: ReadySet, loads: dict[str, int]) -> None:
    for r in ready_set.replicas:
        r.inflight = loads.get(r.url, 0)


async def test_a_family_one_proxy_placed_is_routed_there_by_the_other(two: list[Proxy]) -> None:
    (_, a, _), (_, b, _) = two
    body, fresh = bodies(2, seed=71)
    chosen = a.choose(None, Req(body))
    assert chosen is not None
    fid = family(a, body)
    await until(lambda: primary_url(b, fid) == chosen.url, what="b to learn a's placement")
    # On b the chosen replica is busier than the others: b alone would place elsewhere
    # (a fresh family shows it), but the shared family still goes where a placed it.
    set_loads(b, {r.url: 3 if r.url == chosen.url else 2 for r in b.replicas})
    own = b.choose(None, Req(fresh))
    assert own is not None and own.url != chosen.url
    shared = b.choose(None, Req(body))
    assert shared is not None and shared.url == chosen.url


async def test_two_proxies_placing_one_family_at_once_converge(two: list[Proxy]) -> None:
    (_, a, _), (_, b, _) = two
    body = bodies(1, seed=81)[0]
    urls = [r.url for r in a.replicas]
    # Each sees another replica idle: each alone places the family on another one.
    set_loads(a, {u: 1 for u in urls[1:]})
    set_loads(b, {u: 1 for u in urls if u != urls[2]})
    first_a, first_b = a.choose(None, Req(body)), b.choose(None, Req(body))
    assert first_a is not None and first_b is not None
    assert first_a.url == urls[0] and first_b.url == urls[2]
    fid = family(a, body)
    await until(lambda: primary_url(a, fid) == primary_url(b, fid),
                what="both proxies to agree on the family's replica")  # fmt: skip
    agreed = primary_url(a, fid)
    assert agreed in (urls[0], urls[2])
    set_loads(a, {})
    set_loads(b, {})
    again_a, again_b = a.choose(None, Req(body)), b.choose(None, Req(body))
    assert again_a is not None and again_b is not None
    assert again_a.url == again_b.url == agreed


async def test_a_new_family_just_placed_on_another_proxy_counts_in_an_idle_fleets_order(
    two: list[Proxy],
) -> None:
    # Unshared prompts on an idle per-slot fleet go where the recent traffic is least; the
    # other proxy's traffic reaches this one through the in-flight hash up to 2 s late. Its
    # new family's placement comes in about 20 ms, and counts at once.
    (_, a, _), (_, b, _) = two
    body, fresh = bodies(2, seed=73)
    chosen = a.choose(None, Req(body))
    assert chosen is not None
    table(a).traffic.clear()  # its traffic not yet in the hash, as for up to 2 s
    on_b = b.known[chosen.url]
    table(b).traffic.update({r: 0.0 if r is on_b else 0.5 for r in b.replicas})
    await until(lambda: table(b).peer_fresh == {on_b: 1}, what="b to count a's new family")
    own = b.choose(None, Req(fresh))  # without it: the replica of the least traffic, on_b
    assert own is not None and own is not on_b
    assert table(a).peer_fresh == {}  # a's own placement, read back, is not counted
    assert table(b).peer_traffic.get(on_b, 0.0) == 0.0


async def test_hostile_placement_entries_are_skipped_counted_and_deleted(
    two: list[Proxy], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    (_, a, stats), (_, b, stats_b) = two
    keys = Keys(redis_prefix)
    key = keys.placement("svc")
    known = a.replicas[0].url
    hostile = {
        "zz": "1.0 " + known,  # not hex
        "123456789": "1.0 " + known,  # more than 8 digits
        "1": "1e400 " + known,  # not finite
        "2": "9999999999.0 " + known,  # from the future: would never expire
        "3": "\xff\xfe garbage",
        "4": "x" * 5000,
    }
    await redis_client.hset(key, mapping=hostile)  # type: ignore[arg-type]
    # Not a replica of the set: skipped (it only expires: a proxy may lag a set change).
    await redis_client.hset(key, "6", f"{time.time():.3f} http://evil.example:1")
    await redis_client.publish(keys.placed("svc"), b"5 nan " + known.encode() + b"\n\x00\x01")
    # Whichever proxy scans first counts and deletes an entry, both count the channel's.
    await until(lambda: stats.placements_skipped + stats_b.placements_skipped
                >= len(hostile) + 1 + 2 * 2,
                what="the hostile entries to be counted")  # fmt: skip
    fams = table(a).families
    assert not {1, 2, 3, 4, 5, 6} & set(fams)
    # Nor do they count as another proxy's new family in an idle fleet's order.
    assert table(a).peer_fresh == {} and table(b).peer_fresh == {}
    await until(lambda: _gone(redis_client, key, hostile), what="the bad entries deleted")
    # Routing is untouched: a new family is placed and shared as usual.
    body = bodies(1, seed=91)[0]
    chosen = a.choose(None, Req(body))
    assert chosen is not None
    await until(lambda: primary_url(b, family(a, body)) == chosen.url,
                what="b to learn the placement")  # fmt: skip


async def _gone(client: aioredis.Redis, key: str, fields: dict[str, str]) -> bool:
    return not any(await client.hmget(key, list(fields)))  # type: ignore[misc]


async def test_redis_gone_keeps_routing_on_the_last_view(
    redis_factory: Callable[..., EmbeddedRedis], redis_prefix: str
) -> None:
    server = redis_factory()
    async with Store.from_url(server.url, prefix=redis_prefix) as store:
        await registered(store, spec=b"{}")
        await store.commit("svc", replica_updates=[replica(i) for i in range(1, 5)])
    source, ready_set, _ = await start_proxy(server.url, redis_prefix)
    try:
        body, fresh = bodies(2, seed=101)
        chosen = ready_set.choose(None, Req(body))
        assert chosen is not None
        assert source.placement is not None
        await until(lambda: source.placement.published >= 1,  # type: ignore[union-attr]
                    what="the placement to be published")  # fmt: skip
        server.kill()
        set_loads(ready_set, {r.url: 3 if r is chosen else 2 for r in ready_set.replicas})
        assert ready_set.choose(None, Req(body)) is chosen  # the family stays placed
        other = ready_set.choose(None, Req(fresh))  # and new families are placed
        assert other is not None and other is not chosen
        assert primary_url(ready_set, family(ready_set, fresh)) == other.url
    finally:
        await source.aclose()
        ready_set.close()


# -- secondaries (a family's spill replica), shared through the same hash and channel --


def secondary_url(ready_set: ReadySet, fid: int) -> str | None:
    fam = table(ready_set).families.get(fid)
    return None if fam is None or fam.secondary is None else fam.secondary.url


async def placed_on_both(a: ReadySet, b: ReadySet, body: bytes) -> tuple[int, str]:
    """The family of `body` placed by `a`, learnt and routed by `b`: (family, primary URL)."""
    chosen = a.choose(None, Req(body))
    assert chosen is not None
    fid = family(a, body)
    await until(lambda: primary_url(b, fid) == chosen.url, what="b to learn a's placement")
    # b routes it there too (its longest-prefix memory learns the family at home, as
    # from a family's first requests): what follows is about spilling only.
    assert b.choose(None, Req(body)) is not None
    return fid, chosen.url


async def test_a_spill_one_proxy_chose_is_where_the_other_spills(two: list[Proxy]) -> None:
    (_, a, _), (_, b, _) = two
    body = bodies(1, seed=111)[0]
    fid, home = await placed_on_both(a, b, body)
    urls = [r.url for r in a.replicas]
    others = [u for u in urls if u != home]
    # a: its primary saturated (6 of 6 in flight, bound ceil(2 x 7 / 4) = 4): spills to
    # the idle replica it sees.
    set_loads(a, {u: 6 if u == home else 1 for u in urls} | {others[0]: 0})
    spill = a.choose(None, Req(body))
    assert spill is not None and spill.url == others[0]
    await until(lambda: secondary_url(b, fid) == others[0], what="b to learn a's spill")
    # b: saturated too, and others[0] is busier there than the others: b alone would
    # spill to others[1]. But a's request there still computes the prompt (no first
    # byte yet): b's overflow waits at the primary, as a's own does.
    set_loads(b, {home: 6, others[0]: 2, others[1]: 0, others[2]: 1})
    held = Req(body)
    assert b.choose(None, held).url == home and not held.cold  # type: ignore[union-attr]
    assert table(b).families[fid].warming.url == others[0]  # type: ignore[union-attr]
    # a's request has its first byte (Exchange.prefilled): a tells the others, and b's
    # overflow goes to the shared secondary, within its bound.
    table(a).families[fid].warming = None
    await until(lambda: table(b).families[fid].warming is None,
                what="b to learn that the spill replica answered")
    assert b.choose(None, Req(body)).url == others[0]  # type: ignore[union-attr]


async def test_a_secondary_adopted_long_after_it_was_chosen_is_not_held(
    two: list[Proxy],
) -> None:
    (_, a, _), (_, b, _) = two
    body = bodies(1, seed=113)[0]
    fid, home = await placed_on_both(a, b, body)
    fourth = next(r for r in b.replicas if r.url != home)
    # A secondary another proxy wrote WARM_HOLD ago (found by the scan, say): whatever
    # its first request became, it is not waited for.
    tb = table(b)
    tb.adopt_spills([(fid, fourth.url, tb.now - WARM_HOLD - 1)])
    assert tb.families[fid].secondary is fourth and tb.families[fid].warming is None
    fresh = next(r for r in b.replicas if r.url not in (home, fourth.url))
    tb.adopt_spills([(fid, fresh.url, tb.now)])
    assert tb.families[fid].secondary is fresh and tb.families[fid].warming is fresh


async def test_two_proxies_spilling_one_family_at_once_converge(
    two: list[Proxy], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    (_, a, _), (_, b, _) = two
    body = bodies(1, seed=121)[0]
    fid, home = await placed_on_both(a, b, body)
    others = [r.url for r in a.replicas if r.url != home]
    # Each proxy sees another replica idle: each alone spills to another one.
    set_loads(a, {home: 6, others[0]: 0, others[1]: 1, others[2]: 1})
    set_loads(b, {home: 6, others[0]: 1, others[1]: 0, others[2]: 1})
    first_a, first_b = a.choose(None, Req(body)), b.choose(None, Req(body))
    assert first_a is not None and first_b is not None
    assert (first_a.url, first_b.url) == (others[0], others[1])
    await until(lambda: secondary_url(a, fid) == secondary_url(b, fid),
                what="both proxies to agree on the spill")  # fmt: skip
    agreed = secondary_url(a, fid)
    stored = await redis_client.hget(Keys(redis_prefix).placement("svc"), f"s{fid:x}")
    assert stored is not None and stored.split(b" ", 1)[1].decode() == agreed  # first writer
    for ready in (a, b):  # the spilled requests' first bytes came (Exchange.prefilled)
        ready.policy.placement.families[fid].warming = None  # type: ignore[attr-defined]
    again_a, again_b = a.choose(None, Req(body)), b.choose(None, Req(body))
    assert again_a is not None and again_b is not None
    assert again_a.url == again_b.url == agreed


async def test_a_moved_overflow_replaces_the_shared_spill(two: list[Proxy]) -> None:
    (_, a, _), (_, b, _) = two
    body = bodies(1, seed=131)[0]
    fid, home = await placed_on_both(a, b, body)
    others = [r.url for r in a.replicas if r.url != home]
    set_loads(a, {home: 6, others[0]: 0, others[1]: 1, others[2]: 1})
    assert a.choose(None, Req(body)).url == others[0]  # type: ignore[union-attr]
    await until(lambda: secondary_url(b, fid) == others[0], what="b to learn the spill")
    # The spill replica failed this request on a (a retry excludes it), the primary
    # still saturated: the overflow moves, and b follows the move (HSET, not HSETNX).
    failed = {r for r in a.replicas if r.url == others[0]}
    set_loads(a, {home: 6, others[0]: 0, others[1]: 1, others[2]: 0})
    assert a.choose(failed, Req(body)).url == others[2]  # type: ignore[union-attr]
    await until(lambda: secondary_url(b, fid) == others[2], what="b to follow the move")


async def test_hostile_spill_entries_are_skipped_counted_and_deleted(
    two: list[Proxy], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    (_, a, stats), (_, b, stats_b) = two
    body = bodies(1, seed=141)[0]
    fid, home = await placed_on_both(a, b, body)
    other = next(r.url for r in a.replicas if r.url != home)
    keys = Keys(redis_prefix)
    key = keys.placement("svc")
    now = time.time()
    hostile = {
        "s": f"{now:.3f} {other}",  # no family
        "szz": f"{now:.3f} {other}",  # not hex
        "s123456789": f"{now:.3f} {other}",  # more than 8 digits
        "s-1": f"{now:.3f} {other}",  # a sign
        "s 1": f"{now:.3f} {other}",  # a space
        "ss1": f"{now:.3f} {other}",  # twice marked
        "s7": "9999999999.0 " + other,  # from the future: would never expire
        "s8": "inf " + other,
        "s9": "\xff\xfe garbage",
        "sa": "x" * 5000,
    }
    await redis_client.hset(key, mapping=hostile)  # type: ignore[arg-type]
    # Well-formed but not to be followed: a replica outside the set (skipped, counted,
    # left to expire), one older than a secondary lives (deleted, not counted), the
    # family's own primary (ignored).
    await redis_client.publish(keys.placed("svc"),
                               f"s{fid:x} {now:.3f} http://evil.example:1".encode())
    stale = f"{now - 100:.3f} {other}"  # placement_ttl 300: secondaries live 75 s
    await redis_client.hset(key, f"s{fid:x}", stale)
    await redis_client.publish(keys.placed("svc"), f"s{fid:x} {now:.3f} {home}\n".encode()
                               + b"s5 nan " + other.encode() + b"\n\x00\x01")
    await until(lambda: stats.placements_skipped + stats_b.placements_skipped
                >= len(hostile) + 2 * 3,  # the hash's by one proxy, the channel's by both
                what="the hostile entries to be counted")  # fmt: skip
    await until(lambda: _gone(redis_client, key, {**hostile, f"s{fid:x}": ""}),
                what="the bad and stale entries deleted")  # fmt: skip
    assert secondary_url(a, fid) is None and secondary_url(b, fid) is None
    assert not {7, 8, 9, 10} & set(table(a).families)
    assert a.choose(None, Req(body)).url == home  # type: ignore[union-attr]
    # Spilling still works and is still shared.
    set_loads(a, {u.url: 6 if u.url == home else 0 for u in a.replicas})
    spill = a.choose(None, Req(body))
    assert spill is not None and spill.url != home
    await until(lambda: secondary_url(b, fid) == spill.url, what="b to learn the spill")


async def test_hostile_warm_lines_are_skipped_and_release_nothing(
    two: list[Proxy], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    (_, a, stats), (_, b, stats_b) = two
    keys = Keys(redis_prefix)
    body = bodies(1, seed=117)[0]
    fid, home = await placed_on_both(a, b, body)
    set_loads(a, {r.url: 6 if r.url == home else 1 for r in a.replicas})
    spill = a.choose(None, Req(body))
    assert spill is not None and spill.url != home
    await until(lambda: secondary_url(b, fid) == spill.url, what="b to learn the spill")
    other = next(r.url for r in a.replicas if r.url not in (home, spill.url))
    now = time.time()
    # "The first answer came" from replicas that are not the one waited for, from one
    # outside the set (counted), and malformed lines (counted): b keeps waiting.
    seen = stats_b.placements_skipped
    await redis_client.publish(keys.placed("svc"), "\n".join([
        f"w{fid:x} {now:.3f} {other}",
        f"w{fid:x} {now:.3f} {home}",
        f"w{fid:x} {now:.3f} http://evil.example:1",
        f"w{fid + 1:x} {now:.3f} {spill.url}",  # another family
        f"wzz {now:.3f} {spill.url}",
        f"w123456789 {now:.3f} {spill.url}",
        f"ww{fid:x} {now:.3f} {spill.url}",
        f"w{fid:x} nan {spill.url}",
    ]).encode())
    await until(lambda: stats_b.placements_skipped >= seen + 5, what="the lines counted")
    assert table(b).families[fid].warming is not None
    # Never stored: a `w` field in the hash is hostile, deleted and counted.
    await redis_client.hset(keys.placement("svc"), f"w{fid:x}", f"{now:.3f} {spill.url}")
    await until(lambda: _gone(redis_client, keys.placement("svc"), {f"w{fid:x}": ""}),
                what="the stored w field deleted")
    assert table(b).families[fid].warming is not None
    assert stats.placements_skipped + stats_b.placements_skipped >= seen + 6
    # The real one releases it.
    table(a).families[fid].warming = None
    await until(lambda: table(b).families[fid].warming is None, what="b to be released")


async def test_a_shared_spill_whose_replica_left_the_set_is_not_followed(
    store: Store, two: list[Proxy], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    (_, a, _), (_, b, stats_b) = two
    body = bodies(1, seed=151)[0]
    fid, home = await placed_on_both(a, b, body)
    others = [r for r in a.replicas if r.url != home]
    gone = others[0]
    set_loads(a, {r.url: 6 if r.url == home else (0 if r is gone else 1) for r in a.replicas})
    assert a.choose(None, Req(body)) is gone
    await until(lambda: secondary_url(b, fid) == gone.url, what="b to learn the spill")
    # The spill replica leaves the set; its entry stays in the hash (it only expires).
    ids = {f"http://127.0.0.1:{20000 + i}": i for i in range(1, 5)}
    await store.commit("svc", replica_updates=[
        replica(ids[gone.url], status=ReplicaStatus.NOT_READY)])
    await until(lambda: len(a.replicas) == len(b.replicas) == 3, what="the set to shrink")
    assert secondary_url(a, fid) is None and secondary_url(b, fid) is None
    seen = stats_b.placements_skipped
    await redis_client.publish(Keys(redis_prefix).placed("svc"),
                               f"s{fid:x} {time.time():.3f} {gone.url}".encode())
    await until(lambda: stats_b.placements_skipped > seen, what="the message to be skipped")
    assert secondary_url(b, fid) is None
    for ready_set in (a, b):
        set_loads(ready_set, {home: 6})
        spill = ready_set.choose(None, Req(body))
        assert spill is not None and spill.url not in (home, gone.url)


# -- spilled turns: a conversation's next turn follows its spill on any proxy -------------


def conversation(seed: int) -> tuple[bytes, bytes, bytes]:
    """(another conversation of the family, a turn, the conversation's next turn)."""
    system = f"System prompt {seed}. " + LONG
    question = "A question long enough to fill several blocks of the key. " * 12
    return (chat(system, "Something else entirely. " * 12), chat(system, question),
            chat(system, question, "An answer. " * 20, "A follow-up?"))


async def test_the_next_turn_follows_a_turn_that_spilled_on_another_proxy(
    two: list[Proxy],
) -> None:
    (_, a, _), (_, b, _) = two
    other, turn, after = conversation(161)
    _, home = await placed_on_both(a, b, other)
    set_loads(a, {r.url: 6 if r.url == home else 0 for r in a.replicas})
    spill = a.choose(None, Req(turn))
    assert spill is not None and spill.url != home
    # b never saw this conversation: by its family alone it goes home (no load on b);
    # once a's announcement arrives, its next turn follows its history to the spill.
    assert b.choose(None, Req(after.replace(b"A question", b"B question"))).url == home  # type: ignore[union-attr]
    policy = b.policy
    block = policy.key_of(Req(turn))[-2]  # type: ignore[attr-defined]
    await until(lambda: block in policy._lru, what="b to learn the spilled turn")  # type: ignore[attr-defined]
    assert b.choose(None, Req(after)).url == spill.url  # type: ignore[union-attr]


async def test_hostile_spilled_turns_are_skipped_and_counted(
    two: list[Proxy], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    (_, a, stats), (_, _, stats_b) = two
    other, turn, _ = conversation(171)
    _, home = await placed_on_both(a, a, other)
    block = a.policy.key_of(Req(turn))[-2]  # type: ignore[attr-defined]
    keys = Keys(redis_prefix)
    now = time.time()
    lines = [
        f"t {now:.3f} {home}",  # no block
        f"tzz {now:.3f} {home}",  # not hex
        f"t123456789 {now:.3f} {home}",  # more than 8 digits
        f"t{block:x} nan {home}",
        f"t{block:x} {now:.3f} http://evil.example:1",  # not a replica of the set
        f"t{block:x} 9999999999.0 {home}",  # from the future
    ]
    await redis_client.publish(keys.placed("svc"), "\n".join(lines).encode())
    # Spilled turns are never stored: one in the hash is deleted by the scan.
    await redis_client.hset(keys.placement("svc"), f"t{block:x}", f"{now:.3f} {home}")
    await until(lambda: stats.placements_skipped + stats_b.placements_skipped
                >= 2 * len(lines) + 1,
                what="the hostile turns to be counted")  # fmt: skip
    await until(lambda: _gone(redis_client, keys.placement("svc"), {f"t{block:x}": ""}),
                what="the stored turn deleted")  # fmt: skip
    assert block not in a.policy._lru  # type: ignore[attr-defined]
    # Stale (older than a secondary lives): not learnt, not counted.
    seen = stats.placements_skipped
    await redis_client.publish(keys.placed("svc"), f"t{block:x} {now - 100:.3f} {home}\n"
                               "zz 1.0 x".encode())  # fmt: skip
    await until(lambda: stats.placements_skipped == seen + 1, what="the message handled")
    assert block not in a.policy._lru  # type: ignore[attr-defined]


# -- a hash full of one-off prompts: new families are still shared ------------------------


async def test_a_hash_full_of_one_off_prompts_still_shares_new_families(
    two: list[Proxy], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    # Unique prompts (no system prompt, every question new) each make a family, each
    # published. Once the hash held `max_entries` of them, a proxy skipped publishing
    # until entries expired (the TTL, 5 minutes): every new family, and every session's
    # next turn on another proxy, was decided per proxy, cold on each.
    (source_a, a, _), (_, b, _) = two
    sync = source_a.placement
    assert sync is not None
    key = Keys(redis_prefix).placement("svc")
    cap = sync.max_entries(table(a))
    urls = [r.url for r in a.replicas]
    # A family a uses now, placed a while ago: its entry is among the oldest.
    kept = bodies(1, seed=181)[0]
    home = a.choose(None, Req(kept))
    assert home is not None
    fid_kept = family(a, kept)
    await until(lambda: primary_url(b, fid_kept) == home.url, what="b to learn the family")
    now = time.time()
    await redis_client.hset(key, f"{fid_kept:x}", f"{now - 120:.3f} {home.url}")
    one_offs = {f"{0x10000 + i:x}": f"{now - 60 + i / 100:.3f} {urls[i % 4]}"
                for i in range(cap + 40)}  # fmt: skip
    await redis_client.hset(key, mapping=one_offs)  # type: ignore[arg-type]
    # The scans make room, oldest first: the hash goes back under its cap.
    await until(lambda: _hlen_below(redis_client, key, cap), what="room made in the hash")
    # A new family placed on a is shared with b at once (the channel), and stored.
    body = bodies(1, seed=182)[0]
    chosen = a.choose(None, Req(body))
    assert chosen is not None
    fid = family(a, body)
    await until(lambda: primary_url(b, fid) == chosen.url, what="b to learn the new family")
    assert await redis_client.hget(key, f"{fid:x}") is not None
    # The family a still uses kept its entry; the oldest one-offs went.
    assert a.choose(None, Req(kept)) is home
    assert await redis_client.hget(key, f"{fid_kept:x}") is not None
    assert await redis_client.hget(key, f"{0x10000:x}") is None


async def _hlen_below(client: aioredis.Redis, key: str, cap: int) -> bool:
    return int(await client.hlen(key)) < cap  # type: ignore[misc]


async def test_the_engine_view_reaches_the_placement_table_when_it_is_read(
    store: Store, two: list[Proxy]
) -> None:
    # Capacities (llama.cpp's slots) and the engines' kind (batching or one cache per
    # slot: how an idle fleet's new family is placed) follow the view as it is applied,
    # not at the table's next refresh up to a second later.
    from proxy.wire.engines import EngineStats, EngineView

    _, ready_set, _ = two[0]
    t = table(ready_set)
    assert not t.batching  # no view: one cache per slot assumed
    for kind, slots in (("llamacpp", 2), ("vllm", None)):
        await store.telemetry.write_engines({"svc": EngineView(service="svc", replicas={
            str(n): EngineStats(url=r.url, engine=kind, at=time.time(), slots=slots)
            for n, r in enumerate(ready_set.replicas, 1)})}, ttl=10)  # fmt: skip
        await until(lambda kind=kind: all(  # type: ignore[misc]
            r.engine is not None and r.engine.engine == kind  # type: ignore[attr-defined]
            for r in ready_set.replicas), what=f"the {kind} view")
        assert t.batching is (kind == "vllm")
        if slots:
            assert set(t.capacity.values()) == {slots}
