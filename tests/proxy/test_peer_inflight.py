"""The fleet's in-flight view (`--fleet-load`): RedisSource reads the other proxies'
entries of the `inflight` hash in its once-a-second round trip and sets each replica's
`peer_inflight`, which the `prefix` policy's load bound for a known family counts. Hostile and stale
entries are skipped and never touch serving (a real redis-server, a real RedisSource
and ReadySet; other proxies' entries are written as another proxy user would)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import redis.asyncio as aioredis

from controlplane.store import Store
from proxy.config import ProxyConfig
from proxy.readyset import ReadySet
from proxy.replica import Replica
from proxy.sources.redis import MAX_PEERS, PEER_FRESH, RedisSource, fleet_wanted
from proxy.stats import Stats
from proxy.wire.engines import EngineStats
from proxy.wire.keys import Keys
from proxy.wire.snapshot import PrefixOptions
from tests.proxy.test_prefix import URLS, Req, bodies, cold_options, snapshot
from tests.support.builders import registered, replica
from tests.support.poll import until

OWN = "this-proxy:1"


async def _follow(store: Store, redis_url: str, redis_prefix: str, *,
                  fleet_load: str, policy: str | None = None) -> tuple[RedisSource, ReadySet]:
    await registered(store, spec=b"{}")
    await store.commit("svc", replica_updates=[replica(1), replica(2)])
    config = ProxyConfig(redis_url=redis_url, service="svc", redis_prefix=redis_prefix,
                         proxy_id=OWN, fleet_load=fleet_load)  # fmt: skip
    ready_set = ReadySet(policy_override=policy)
    source = RedisSource(config, Stats(), flush_interval=0.05)
    await source.start(ready_set)
    return source, ready_set


@pytest.fixture
async def followed(
    store: Store, redis_url: str, redis_prefix: str
) -> AsyncIterator[tuple[ReadySet, str]]:
    source, ready_set = await _follow(store, redis_url, redis_prefix, fleet_load="on")
    yield ready_set, Keys(redis_prefix).inflight("svc")
    await source.aclose()
    ready_set.close()


def entry(replicas: dict[str, int], at: float | None = None) -> bytes:
    at = time.time() if at is None else at
    return msgspec.json.encode({"at": at, "total": sum(replicas.values()), "replicas": replicas})


def traffic_entry(traffic: dict[str, float]) -> bytes:
    return msgspec.json.encode({"at": time.time(), "traffic": traffic})


def peers(ready_set: ReadySet) -> dict[int, int]:
    return {r.id: r.peer_inflight for r in ready_set.known.values()}


def seen(ready_set: ReadySet) -> dict[int, int]:
    """The same counts as `peer_seen` (set with or without --fleet-load)."""
    return {r.id: r.peer_seen for r in ready_set.known.values()}


async def test_the_other_proxies_counts_are_summed_per_replica(
    redis_client: aioredis.Redis, followed: tuple[ReadySet, str]
) -> None:
    ready_set, key = followed
    one, two = (r.url for r in ready_set.replicas)
    await redis_client.hset(key, mapping={
        "peer-a:1": entry({one: 3, two: 1}),
        "peer-b:2": entry({one: 2, "http://127.0.0.1:1": 50}),  # a URL not in the set
    })  # fmt: skip
    await until(lambda: peers(ready_set) == {1: 5, 2: 1}, what="the peers' counts")
    # This proxy's own entry is its live count, never added twice.
    await redis_client.hset(key, OWN, entry({one: 40}))
    await redis_client.hdel(key, "peer-b:2")
    await until(lambda: peers(ready_set) == {1: 3, 2: 1}, what="peer-b's entry gone")


async def test_the_proxies_share_their_recent_traffic_per_replica(
    store: Store, redis_client: aioredis.Redis, redis_url: str, redis_prefix: str
) -> None:
    # The prefix policy orders an idle per-slot fleet (llama.cpp) by recent traffic for a
    # new family: this proxy publishes its own with its in-flight counts, and adds the
    # others' (with or without --fleet-load) to it.
    source, ready_set = await _follow(store, redis_url, redis_prefix, fleet_load="off",
                                      policy="prefix")
    key = Keys(redis_prefix).inflight("svc")
    # placement: auto (the default) turns placement on once the source shares it.
    table = await until(lambda: ready_set.policy.placement,  # type: ignore[attr-defined]
                        what="the shared placement to be on")
    one, two = ready_set.replicas
    try:
        await redis_client.hset(key, mapping={
            "peer-a:1": traffic_entry({one.url: 4.5, two.url: 1.0}),
            "peer-b:2": traffic_entry({one.url: 2.0, "http://127.0.0.1:1": 9.0}),
        })  # fmt: skip
        await until(lambda: table.peer_traffic == {one: 6.5, two: 1.0},
                    what="the peers' traffic summed")
        table.traffic[two] = 3.27  # what this proxy routed there (the policy counts it)

        async def published() -> bool:  # to a tenth of a request
            raw = await redis_client.hget(key, OWN)
            return raw is not None and msgspec.json.decode(raw).get("traffic") == {two.url: 3.3}

        await until(published, what="this proxy's traffic published")
        # This proxy's own entry is never added to the others'.
        assert table.peer_traffic == {one: 6.5, two: 1.0}
        await redis_client.hdel(key, "peer-a:1", "peer-b:2")
        await until(lambda: table.peer_traffic == {}, what="the peers' entries gone")
    finally:
        await source.aclose()
        ready_set.close()


async def test_without_fleet_load_the_other_proxies_counts_are_not_counted(
    store: Store, redis_client: aioredis.Redis, redis_url: str, redis_prefix: str
) -> None:
    source, ready_set = await _follow(store, redis_url, redis_prefix, fleet_load="off")
    key = Keys(redis_prefix).inflight("svc")
    only = ready_set.replicas[0]
    try:
        await redis_client.hset(key, "peer-a:1", entry({only.url: 9}))

        async def flushed(count: int) -> bool:  # this proxy's own entry says `count`
            raw = await redis_client.hget(key, OWN)
            return raw is not None and f'"total":{count}'.encode() in raw

        # Two flushes after the peer's entry: the first one's reads are applied by then.
        only.inflight = 1
        await until(lambda: flushed(1), what="a flush after the peer's entry")
        only.inflight = 2
        await until(lambda: flushed(2), what="the next flush")
        assert only.peer_inflight == 0
        # Seen all the same (a second old): a family's overflow is placed by it.
        assert only.peer_seen == 9
    finally:
        only.inflight = 0
        await source.aclose()
        ready_set.close()


@pytest.mark.parametrize("fleet_load", ["off", "on"])
async def test_the_spill_margin_is_split_among_the_proxies_with_a_fresh_entry(
    store: Store, redis_client: aioredis.Redis, redis_url: str, redis_prefix: str,
    fleet_load: str,
) -> None:
    source, ready_set = await _follow(store, redis_url, redis_prefix, fleet_load=fleet_load,
                                      policy="prefix")
    key = Keys(redis_prefix).inflight("svc")
    url = ready_set.replicas[0].url

    def margin() -> int:
        return ready_set.policy.spill_margin  # type: ignore[attr-defined, no-any-return]

    try:
        assert margin() == 8  # alone
        await redis_client.hset(key, mapping={
            "peer-a:1": entry({url: 1}), "peer-b:2": entry({url: 1}),
            "peer-c:3": entry({url: 1}, at=time.time() - PEER_FRESH - 60),  # stopped
            "peer-d:4": b"not json"})  # fmt: skip
        # 3 proxies: ceil(8 / sqrt(3)) = 5 each. With --fleet-load the loads are the
        # fleet's: the whole margin.
        want = 8 if fleet_load == "on" else 5
        await until(lambda: margin() == want, what=f"margin {want}")
        await redis_client.hdel(key, "peer-a:1", "peer-b:2")
        await until(lambda: margin() == 8, what="alone again")
    finally:
        await source.aclose()
        ready_set.close()


@pytest.mark.parametrize(("engines", "want"), [
    ((), False),  # no engine view (no controller, or it stopped scraping)
    ((None, None), False),
    (("unknown", "unknown"), False),  # scraped, but no engine's metrics
    (("vllm", "vllm"), True),
    (("sglang", "vllm", None), True),  # a replica not scraped yet is left out
    (("vllm", "unknown"), True),
    (("vllm", "llamacpp"), False),  # one cache per slot anywhere: off
    (("llamacpp", "llamacpp"), False),
    (("tgi", "vllm"), True),
])
def test_auto_wants_the_fleets_counts_for_batching_engines_only(
    engines: tuple[str | None, ...], want: bool
) -> None:
    records = [None if kind is None else EngineStats(url=f"http://127.0.0.1:{8000 + n}",
                                                      engine=kind)
               for n, kind in enumerate(engines, 1)]
    assert fleet_wanted(records) is want


@pytest.mark.parametrize(("args", "want"), [
    ([], "auto"),
    (["--fleet-load"], "on"),  # bare, as in earlier releases
    (["--fleet-load", "off"], "off"),
    (["--no-fleet-load"], "off"),
    (["--fleet-load=auto"], "auto"),
])
def test_the_fleet_load_flag(monkeypatch: pytest.MonkeyPatch, args: list[str], want: str) -> None:
    from click.testing import CliRunner

    from proxy import cli

    got: list[ProxyConfig] = []
    monkeypatch.setattr(cli, "_run", lambda config, supervise: got.append(config))
    result = CliRunner().invoke(cli.proxy_command, ["--replicas", "http://127.0.0.1:1", *args])
    assert result.exit_code == 0, result.output
    assert got[0].fleet_load == want
    result = CliRunner().invoke(cli.proxy_command, [
        "--replicas", "http://127.0.0.1:1", "--fleet-load", "always"])
    assert result.exit_code == 2 and "--fleet-load" in result.output and "always" in result.output


def test_a_margin_split_among_many_proxies_is_at_least_one() -> None:
    ready = ReadySet(policy_override="prefix")
    ready.apply(snapshot(1, *URLS[:4]))
    policy = ready.policy
    policy.set_proxies(MAX_PEERS + 1)  # type: ignore[attr-defined]
    assert policy.spill_margin == 1  # type: ignore[attr-defined]
    off = ReadySet(policy_override="prefix", prefix_options=cold_options(spill_margin=0))
    off.apply(snapshot(1, *URLS[:4]))
    off.policy.set_proxies(4)  # type: ignore[attr-defined]
    assert off.policy.spill_margin == 0  # type: ignore[attr-defined]  # still no margin


@pytest.mark.parametrize("bad", [
    b"\xff not json",
    b"[1, 2]",
    b'{"at": 1e18, "replicas": {"URL": 30}}',  # far in the future
    b'{"at": NOW, "replicas": {"URL": -4}}',  # a negative count
    b'{"at": NOW, "replicas": {"URL": 3.5}}',  # not an int
    b'{"at": NOW, "replicas": {"URL": 10000000000}}',  # over MAX_COUNT
    b'{"at": NOW, "replicas": {"URL": "7"}}',
    b'{"at": NOW, "replicas": ["URL", 7]}',
    b'{"at": "NOW", "replicas": {"URL": 30}}',
    b'{"at": STALE, "replicas": {"URL": 30}}',  # a proxy that stopped: its entry stays
    b'{"at": NOW, "replicas": {"URL": 30}, "traffic": {"URL": -1.0}}',
    b'{"at": NOW, "replicas": {"URL": 30}, "traffic": {"URL": 1e300}}',
    b'{"at": NOW, "replicas": {"URL": 30}, "traffic": {"URL": "7"}}',
    b'{"at": NOW, "replicas": {"URL": 30}, "traffic": ["URL", 7]}',
], ids=["garbage", "a-list", "future", "negative", "float", "huge", "string", "list-map",
        "at-string", "stale", "traffic-negative", "traffic-huge", "traffic-string",
        "traffic-list"])  # fmt: skip
async def test_a_hostile_or_stale_entry_is_skipped_and_the_rest_count(
    redis_client: aioredis.Redis, followed: tuple[ReadySet, str], bad: bytes
) -> None:
    ready_set, key = followed
    one, _ = (r.url for r in ready_set.replicas)
    now = time.time()
    bad = (bad.replace(b"URL", one.encode()).replace(b"NOW", repr(now).encode())
           .replace(b"STALE", repr(now - PEER_FRESH - 5).encode()))  # fmt: skip
    await redis_client.hset(key, mapping={"evil:1": bad, "peer-a:1": entry({one: 2})})
    await until(lambda: peers(ready_set)[1] == 2, what="the good entry alone")
    assert seen(ready_set)[1] == 2  # the overflow's order skips it too
    table = getattr(ready_set.policy, "placement", None)
    assert table is None or not table.peer_traffic  # and its traffic counts nowhere
    # The same entry, well-formed and fresh, would count: the test can fail.
    await redis_client.hset(key, "evil:1", entry({one: 30}))
    await until(lambda: peers(ready_set)[1] == 32, what="a good entry in its place")
    assert seen(ready_set)[1] == 32
    assert len(ready_set.replicas) == 2


async def test_more_entries_than_read_are_skipped_not_summed_without_bound(
    redis_client: aioredis.Redis, followed: tuple[ReadySet, str]
) -> None:
    ready_set, key = followed
    one, _ = (r.url for r in ready_set.replicas)
    await redis_client.hset(key, mapping={
        f"flood:{i}": entry({one: 1}) for i in range(MAX_PEERS + 500)})
    await until(lambda: peers(ready_set)[1] > 0, what="the flood to be read")
    assert peers(ready_set)[1] <= MAX_PEERS
    assert 0 < seen(ready_set)[1] <= MAX_PEERS


# -- the policy's side: the bound judges the fleet, not this proxy's share -------------
# (epsilon 1: at the default 3, (1 + 3) x the mean of 4 replicas is all in flight and no
# known family spills, whatever the counts)


def _known_family(options: PrefixOptions) -> tuple[ReadySet, bytes, Replica]:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=options))
    body = bodies(1, seed=5)[0]
    first = ready.choose(None, Req(body))
    assert first is not None
    assert ready.choose(None, Req(body)) is first  # known now, and idle: affinity
    return ready, body, first  # type: ignore[return-value]


@pytest.mark.parametrize("placement", ["rendezvous", "capacity"])
def test_a_family_is_not_spilled_for_this_proxys_small_share(placement: str) -> None:
    """One of four proxies holds 1 request on a family's replica and none elsewhere: on
    its own counts the bound is ceil(2 x 2 / 4) = 1, so the family's next request
    would spill to a cold replica. The fleet holds 9 (8 through the other proxies,
    2 of them on that replica): bound ceil(2 x 10 / 4) = 5, load 3: it stays."""
    ready, body, first = _known_family(cold_options(epsilon=1.0, placement=placement))
    first.inflight = 1
    for r in ready.replicas:
        r.peer_inflight = 2
    assert ready.choose(None, Req(body)) is first
    for r in ready.replicas:  # without the others' counts it spills
        r.peer_inflight = 0
    assert ready.choose(None, Req(body)) is not first


@pytest.mark.parametrize("placement", ["rendezvous", "capacity"])
def test_a_replica_the_other_proxies_filled_is_over_the_bound(placement: str) -> None:
    """This proxy sees the family's replica idle, but the other proxies hold 12 there
    (bound ceil(2 x 13 / 4) = 7): the family spills; the others' requests end, it is
    back."""
    ready, body, first = _known_family(cold_options(epsilon=1.0, placement=placement))
    first.peer_inflight = 12
    moved = ready.choose(None, Req(body))
    assert moved is not None and moved is not first
    first.peer_inflight = 0
    assert ready.choose(None, Req(body)) is first


@pytest.mark.parametrize("placement", ["rendezvous", "capacity"])
def test_a_new_prefix_is_judged_on_this_proxys_own_live_counts(placement: str) -> None:
    """The others' counts are up to a second old (`peer_inflight` with --fleet-load, the
    in-flight hash's `peer_seen` always): a new family (or a unique prompt) is placed as
    if they were not there, or every proxy would herd onto the replica that
    looked idle a second ago (on the simulator: +16-47 % TTFT on unique prompts)."""
    options = cold_options(placement=placement)
    body = bodies(1, seed=9)[0]
    quiet = ReadySet()
    quiet.apply(snapshot(1, *URLS[:4], options=options))
    where = quiet.choose(None, Req(body))
    assert where is not None
    busy = ReadySet()
    busy.apply(snapshot(1, *URLS[:4], options=options))
    for r in busy.replicas:
        r.peer_inflight = r.peer_seen = 30 if r.url == where.url else 0
    chosen = busy.choose(None, Req(body))
    assert chosen is not None and chosen.url == where.url
