"""Load-balancing policies: pure unit tests on fake replicas, then distributions measured
through a real proxy (in-flight counts are what the policies read, so the end-to-end tests
hold slow requests open on purpose)."""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import pytest
from click.testing import CliRunner

from proxy.cli import proxy_command
from proxy.errors import ConfigError
from proxy.policies import (
    POLICIES,
    InstanceAwareLeastLoad,
    LeastLoad,
    PowerOfTwoChoices,
    RoundRobin,
    make_policy,
)
from proxy.readyset import ReadySet
from proxy.wire.policies import POLICY_NAMES
from proxy.wire.snapshot import ReadyReplica
from tests.support.builders import Fake, fakes, snapshot
from tests.support.harness import BASE_ARGS, ManualSource, get_json, inprocess_proxy, replica_stats
from tests.support.poll import until
from tests.support.processes import ProxyFactory, Replica, ReplicaFactory


def picks(policy: object, n: int, exclude: set[Fake] | None = None) -> list[str]:
    return [policy.choose(exclude).name for _ in range(n)]


# -- least_load ---------------------------------------------------------------------


def test_least_load_picks_the_fewest_in_flight() -> None:
    policy = LeastLoad()
    replicas = fakes(3, 1, 4, 2)
    policy.update(replicas)
    assert set(picks(policy, 8)) == {"r1"}
    replicas[1].inflight = 9
    assert set(picks(policy, 8)) == {"r3"}
    assert set(picks(policy, 8, exclude={replicas[3]})) == {"r0"}


def test_least_load_breaks_ties_by_rotating() -> None:
    policy = LeastLoad()
    policy.update(fakes(0, 0, 0))
    assert collections.Counter(picks(policy, 30)) == {"r0": 10, "r1": 10, "r2": 10}
    policy.update(fakes(2, 1, 5, 1))
    assert collections.Counter(picks(policy, 20)) == {"r1": 10, "r3": 10}


@pytest.mark.parametrize("make", [LeastLoad, InstanceAwareLeastLoad, RoundRobin, PowerOfTwoChoices])
def test_the_set_shrinking_by_several_keeps_every_policy_in_bounds(make) -> None:
    # Found by the scale-down load test: the rotation index pointed past the end of a
    # set that shrank from 3 to 1, and the next request hit an IndexError.
    policy = make()
    policy.update(fakes(0, 0, 0))
    picks(policy, 2)  # the rotation now starts at the third replica
    policy.update(fakes(0))
    assert picks(policy, 3) == ["r0", "r0", "r0"]


def test_least_load_empty_or_all_excluded_is_none() -> None:
    policy = LeastLoad()
    assert policy.choose(None) is None
    replicas = fakes(0, 0)
    policy.update(replicas)
    assert policy.choose(set(replicas)) is None


# -- round_robin --------------------------------------------------------------------


def test_round_robin_cycles_through_every_replica_regardless_of_load() -> None:
    policy = RoundRobin()
    replicas = fakes(50, 0, 0, 0)
    policy.update(replicas)
    seen = picks(policy, 12)
    for window in (seen[0:4], seen[4:8], seen[8:12]):
        assert sorted(window) == ["r0", "r1", "r2", "r3"]
    assert seen[0:4] == seen[4:8] == seen[8:12]
    after = picks(policy, 8, exclude={replicas[2]})
    assert set(after) == {"r0", "r1", "r3"}
    assert policy.choose(set(replicas)) is None


def test_round_robin_reshuffles_on_every_update() -> None:
    policy = RoundRobin()
    replicas = fakes(*[0] * 6)
    orders = set()
    for _ in range(20):
        policy.update(replicas)
        order = tuple(picks(policy, 6))
        assert sorted(order) == sorted(r.name for r in replicas)
        orders.add(order)
    # 20 updates of 6 replicas (720 orders): one order every time would mean no reshuffle.
    assert len(orders) > 5


# -- instance_aware_least_load ------------------------------------------------------------


def test_instance_aware_divides_in_flight_by_target_qps() -> None:
    policy = InstanceAwareLeastLoad({"A100": 4.0, "T4": 1.0})
    big = Fake("big", inflight=3, accelerator="A100")  # 3 / 4 = 0.75
    small = Fake("small", inflight=1, accelerator="T4")  # 1 / 1 = 1.0
    policy.update([big, small])
    assert set(picks(policy, 6)) == {"big"}
    big.inflight = 5  # 1.25 > 1.0
    assert set(picks(policy, 6)) == {"small"}


def test_instance_aware_accelerator_count_suffix_falls_back_to_base_name() -> None:
    policy = InstanceAwareLeastLoad({"A100": 4.0})
    a100x1 = Fake("a100x1", inflight=3, accelerator="A100:1")  # 3 / 4, via "A100"
    plain = Fake("plain", inflight=1, accelerator="L4")  # unknown: 1 / 1.0
    policy.update([a100x1, plain])
    assert policy.weight_of(a100x1) == 4.0
    assert set(picks(policy, 6)) == {"a100x1"}


def test_instance_aware_exact_name_wins_and_unknown_is_one() -> None:
    policy = InstanceAwareLeastLoad({"A100:8": 16.0, "A100": 4.0})
    assert policy.weight_of(Fake("x", accelerator="A100:8")) == 16.0
    assert policy.weight_of(Fake("x", accelerator="A100:2")) == 4.0
    assert policy.weight_of(Fake("x", accelerator="TPU-v5")) == 1.0
    assert policy.weight_of(Fake("x", accelerator=None)) == 1.0
    # The controller's own figure for a replica beats the accelerator map.
    own = Fake("x", accelerator="A100", target_qps=2.5)
    assert policy.weight_of(own) == 2.5


def test_instance_aware_weights_are_built_on_update_and_ties_rotate() -> None:
    policy = InstanceAwareLeastLoad({"A100": 2.0})
    replicas = [Fake("a", accelerator="A100"), Fake("b", accelerator="A100")]
    policy.update(replicas)
    assert collections.Counter(picks(policy, 10)) == {"a": 5, "b": 5}
    assert policy.choose(set(replicas)) is None


# -- p2c ------------------------------------------------------------------------------


def test_p2c_takes_the_less_loaded_of_two_distinct_choices() -> None:
    policy = PowerOfTwoChoices()
    replicas = fakes(0, 5, 10)
    policy.update(replicas)
    counts = collections.Counter(picks(policy, 300))
    # Two distinct samples: the busiest can never win, the idlest wins 2 of 3 pairs.
    assert "r2" not in counts
    assert 150 < counts["r0"] < 250
    assert counts["r1"] > 50
    policy.update(fakes(3, 1))
    assert set(picks(policy, 20)) == {"r1"}


def test_p2c_exclusion_and_edges() -> None:
    policy = PowerOfTwoChoices()
    assert policy.choose(None) is None
    replicas = fakes(9, 0, 4)
    policy.update(replicas)
    assert set(picks(policy, 30, exclude={replicas[1]})) == {"r2"}
    assert set(picks(policy, 5, exclude={replicas[1], replicas[2]})) == {"r0"}
    assert policy.choose(set(replicas)) is None


# -- the registry ----------------------------------------------------------------------


def test_registry_and_make_policy() -> None:
    assert tuple(POLICIES) == POLICY_NAMES
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    aware = make_policy("instance_aware_least_load", {"H100": 8.0})
    assert aware.weight_of(Fake("x", accelerator="H100:4")) == 8.0


def test_unknown_policy_is_a_config_error_listing_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        make_policy("fastest")
    message = str(info.value)
    assert "fastest" in message
    for name in POLICY_NAMES:
        assert name in message


def test_unknown_policy_on_the_command_line_is_refused_at_startup() -> None:
    result = CliRunner().invoke(
        proxy_command, ["--replicas", "http://127.0.0.1:1", "--policy", "fastest"])
    assert result.exit_code == 2
    for name in POLICY_NAMES:
        assert name in result.output


def test_ready_set_follows_the_snapshot_policy_unless_overridden() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, "http://a:1", "http://b:1", policy="round_robin"))
    assert ready.policy.name == "round_robin"
    ready.apply(snapshot(2, "http://a:1", policy="p2c"))
    assert ready.policy.name == "p2c"
    assert {ready.choose(None).url for _ in range(5)} == {"http://a:1"}
    ready.apply(snapshot(3, "http://b:1", policy="no_such_policy"))
    assert ready.policy.name == "p2c"  # kept, not crashed
    assert ready.choose(None).url == "http://b:1"
    pinned = ReadySet(policy_override="least_load")
    pinned.apply(snapshot(1, "http://a:1", policy="round_robin"))
    assert pinned.policy.name == "least_load"


def test_round_robin_order_is_reshuffled_when_the_set_changes() -> None:
    ready = ReadySet()
    urls = [f"http://r{i}:1" for i in range(6)]
    orders = set()
    for gen in range(1, 21):
        ready.apply(snapshot(gen, *urls, policy="round_robin"))
        orders.add(tuple(ready.choose(None).url for _ in urls))
    assert len(orders) > 5


# -- distributions through a real proxy ------------------------------------------------------


async def _hold_slow(session: aiohttp.ClientSession, url: str, delay: float) -> int:
    async with session.get(f"{url}/slow?delay={delay}") as resp:
        await resp.read()
        return resp.status


async def _fast_counts(session: aiohttp.ClientSession, url: str, n: int) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        async with session.get(f"{url}/fast") as resp:
            assert resp.status == 200
            await resp.read()
            counts[resp.headers["X-Replica-Id"]] += 1
    return dict(counts)


async def _distribution_with_one_busy(
    policy: str, proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> tuple[Replica, dict[str, int]]:
    """Hold one slow request on one replica, then send 10 fast ones one at a time."""
    reps = await replica_factory.astart(2, ids=["a", "b"])
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", policy, replicas=reps)
    async with aiohttp.ClientSession() as s:
        slow = asyncio.create_task(_hold_slow(s, proxy.url, 3.0))
        try:
            async def busy_one() -> Replica | None:
                for r in reps:
                    if (await replica_stats(r))["in_flight"] == 1:
                        return r
                return None
            busy = await until(busy_one, what="the slow request in flight")
            counts = await _fast_counts(s, proxy.url, 10)
        finally:
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
    return busy, counts


async def test_least_load_end_to_end_avoids_the_busy_replica(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    busy, counts = await _distribution_with_one_busy("least_load", proxy_factory,
                                                     replica_factory)
    idle = "b" if busy.id == "a" else "a"
    assert counts == {idle: 10}


async def test_p2c_end_to_end_avoids_the_busy_replica(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    busy, counts = await _distribution_with_one_busy("p2c", proxy_factory, replica_factory)
    idle = "b" if busy.id == "a" else "a"
    assert counts == {idle: 10}


async def test_round_robin_end_to_end_ignores_load(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    _, counts = await _distribution_with_one_busy("round_robin", proxy_factory,
                                                  replica_factory)
    assert counts == {"a": 5, "b": 5}


async def test_instance_aware_end_to_end_weights_by_accelerator(
    replica_factory: ReplicaFactory,
) -> None:
    big, small = await replica_factory.astart(2, ids=["big", "small"])
    source = ManualSource()
    async with inprocess_proxy(source, target_qps={"A100": 4.0, "T4": 1.0}) as app:
        source.publish(ReadyReplica(id=1, url=big.url, accelerator="A100:1"),
                       ReadyReplica(id=2, url=small.url, accelerator="T4"),
                       policy="instance_aware_least_load")
        assert app.ready_set.policy.name == "instance_aware_least_load"
        url = f"http://127.0.0.1:{app.port}"
        async with aiohttp.ClientSession() as s:
            # Five held at once: in-flight/QPS balances at 4 on the A100 and 1 on the T4
            # (equal weights, i.e. without the "A100:1" -> "A100" match, would give 3 and 2).
            held = [asyncio.create_task(_hold_slow(s, url, 1.0)) for _ in range(5)]
            try:
                await until(lambda: sum(r.inflight for r in app.ready_set.replicas) == 5,
                            what="five requests in flight")
                by_id = {r.url: r.inflight for r in app.ready_set.replicas}
                assert by_id == {big.url: 4, small.url: 1}
                assert await asyncio.gather(*held) == [200] * 5
            finally:
                for task in held:
                    task.cancel()
        assert (await replica_stats(big))["by_path"]["/slow"] == 4
        assert (await replica_stats(small))["by_path"]["/slow"] == 1


async def test_policy_switches_with_the_snapshot(replica_factory: ReplicaFactory) -> None:
    reps = await replica_factory.astart(2, ids=["a", "b"])
    source = ManualSource()
    async with inprocess_proxy(source) as app:
        url = f"http://127.0.0.1:{app.port}"
        async with aiohttp.ClientSession() as s:
            source.publish(*(r.url for r in reps), policy="round_robin")
            assert app.ready_set.policy.name == "round_robin"
            slow = asyncio.create_task(_hold_slow(s, url, 3.0))
            try:
                await until(lambda: sum(r.inflight for r in app.ready_set.replicas) == 1,
                            what="one request in flight")
                assert await _fast_counts(s, url, 4) == {"a": 2, "b": 2}
                source.publish(*(r.url for r in reps), policy="least_load")
                assert app.ready_set.policy.name == "least_load"
                [busy] = [r for r in app.ready_set.replicas if r.inflight == 1]
                idle = next(r.id for r in reps if r.url != busy.url)
                assert await _fast_counts(s, url, 4) == {idle: 4}
            finally:
                slow.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await slow


async def test_admin_snapshot_names_the_policy_in_force(
    proxy_factory: ProxyFactory, replica_factory: ReplicaFactory,
) -> None:
    reps = await replica_factory.astart(1)
    proxy = await proxy_factory.astart(*BASE_ARGS, "--policy", "p2c", replicas=reps)
    status, body = await get_json(f"{proxy.admin_url}/snapshot")
    assert status == 200
    assert body["policy"] == "p2c"
    assert body["snapshot"]["policy"] == "p2c"


def test_least_load_and_p2c_count_the_engine_queue() -> None:
    """With --engine-load the proxy sets `engine_queue` (0 otherwise): a replica whose
    engine queues requests other proxies sent looks as loaded as it is."""
    from proxy.policies import LeastLoad, PowerOfTwoChoices
    from tests.support.builders import fakes

    a, b = fakes(1, 2)
    a.engine_queue = 5
    least = LeastLoad()
    least.update([a, b])
    assert {least.choose(None) for _ in range(4)} == {b}
    p2c = PowerOfTwoChoices()
    p2c.update([a, b])
    assert {p2c.choose(None) for _ in range(20)} == {b}
    a.engine_queue = 0
    assert {least.choose(None) for _ in range(4)} == {a}
