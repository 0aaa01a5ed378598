"""Placement of prompt families by load and free cache capacity (proxy/placement.py,
the `prefix` policy's default `placement: capacity`): capacity respected, new families
spread by load, a saturated replica's family spills to one more replica, a family
whose replica left moves, stale families expire (refreshed by the sweeper when no shared
placement task does), other proxies' placements adopted."""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest

from controlplane.servicespec.service import PrefixRouting
from proxy.config import ProxyConfig
from proxy.interfaces import ReplicaView
from proxy.placement import PEER_FRESH, TRAFFIC_HALF_LIFE, WARM_HOLD, Family, PlacementTable
from proxy.prefix import SPILL
from proxy.readyset import PLACEMENT_STALE, ReadySet
from proxy.replica import Replica
from proxy.server import STREAM_SWEEP_EVERY, ServerContext
from proxy.stats import Stats
from proxy.wire.engines import EngineStats
from proxy.wire.snapshot import PrefixOptions, ReadySnapshot
from tests.proxy.test_prefix import LONG, RDV, URLS, Req, bodies, chat, cold_options
from tests.proxy.test_prefix import snapshot as prefix_snapshot

CAP = cold_options(placement="capacity")


def snapshot(gen: int, *urls: str, options: PrefixOptions = CAP) -> ReadySnapshot:
    return prefix_snapshot(gen, *urls, options=options)


def family_of(ready: ReadySet, body: bytes) -> int:
    return ready.policy.key_of(Req(body))[0]  # type: ignore[attr-defined]


def placed(ready: ReadySet, families: list[bytes]) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for body in families:
        chosen = ready.choose(None, Req(body))
        assert chosen is not None
        out[chosen.url] += 1
    return out


def with_slots(ready: ReadySet, slots: int, engine: str = "llamacpp") -> None:
    for r in ready.replicas:
        r.engine = EngineStats(url=r.url, engine=engine, slots=slots)  # type: ignore[attr-defined]
    ready.policy.placement.refresh(1.0)  # type: ignore[attr-defined]  # what the source's tick does


def forget_families(ready: ReadySet) -> None:
    """Empty the placement table (the replicas' counts stay): the next body is new."""
    ready.policy.placement.families.clear()  # type: ignore[attr-defined]
    ready.policy.placement.update(ready.replicas)  # type: ignore[attr-defined]


def three_replicas_one_family(engine: str, seed: int, n: int,
                              ) -> tuple[ReadySet, ReplicaView, ReplicaView, ReplicaView,
                                         list[bytes]]:
    """3 replicas of `engine` with 4 slots each; the first of `n` new bodies placed on
    `a`; returns the set, a, the two others and the other bodies."""
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:3]))
    with_slots(ready, 4, engine)
    first, *others = bodies(n, seed=seed)
    a = ready.choose(None, Req(first))
    assert a is not None
    b, c = (r for r in ready.replicas if r is not a)
    return ready, a, b, c, others


def test_families_fill_every_replica_to_its_slots_where_rendezvous_piles_them_up() -> None:
    families = bodies(8, seed=5)
    rdv = ReadySet()
    rdv.apply(snapshot(1, *URLS[:4], options=RDV))
    assert max(placed(rdv, families).values()) >= 3  # the hash alone: one replica thrashes
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4]))
    with_slots(ready, 2)
    assert sorted(placed(ready, families).values()) == [2, 2, 2, 2]
    # Asked again (idle replicas): every family stays where it was placed.
    again = {b: ready.choose(None, Req(b)) for b in families}
    assert {b: ready.choose(None, Req(b)) for b in families} == again


def test_capacity_from_the_engine_beats_the_configured_default() -> None:
    ready = ReadySet()
    one_each = cold_options(replica_families=1, placement="capacity")
    ready.apply(snapshot(1, *URLS[:2], options=one_each))
    by_url = {r.url: r for r in ready.replicas}
    by_url[URLS[0]].engine = EngineStats(url=URLS[0], slots=3)  # type: ignore[attr-defined]
    ready.policy.placement.refresh(1.0)  # type: ignore[attr-defined]
    # 3 slots on one, the default 1 on the other: 4 families fill both exactly.
    assert placed(ready, bodies(4, seed=9)) == {URLS[0]: 3, URLS[1]: 1}


def test_a_new_family_goes_to_the_least_loaded_replica_with_room() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4]))
    loads = dict(zip(URLS[:4], (3, 1, 0, 2), strict=True))
    for r in ready.replicas:
        r.inflight = loads[r.url]
    for body in bodies(20, seed=21):
        chosen = ready.choose(None, Req(body))
        assert chosen is not None and chosen.url == URLS[2]  # the idle one, whatever the hash
        forget_families(ready)


def test_a_cold_prefill_in_flight_counts_twice_in_a_new_familys_order() -> None:
    # Two new families 40 ms apart both went to the least loaded replica, whose first cold
    # prefill then delayed the second and every request behind it (the simulator's p99).
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:3]))
    first, second, third, fourth = bodies(4, seed=23)
    request = Req(first)
    a = ready.choose(None, request)
    assert a is not None and request.cold  # a new family: a predicted miss
    a.inflight, a.prefilling = 1, 1  # what the exchange counts until its first byte
    b, c = (r for r in ready.replicas if r is not a)
    b.inflight, c.inflight = 2, 3  # a new prefix's bound: 3, so c is out
    assert ready.choose(None, Req(second)) is b  # a counts 2, as b; b holds no family
    # Its prefill done (the response began), the least loaded takes the next one again.
    a.prefilling = 0
    assert ready.choose(None, Req(third)) is a
    # Counted twice, not shunned: a still beats a replica with 3 in flight.
    a.prefilling = 1
    b.inflight, c.inflight = 3, 5  # bound 4: b in, c out
    assert ready.choose(None, Req(fourth)) is a
    # A known family is no cold prefill: not marked, and not moved off its replica.
    again = Req(first)
    assert ready.choose(None, again) is a and not again.cold


def test_on_batching_engines_a_new_family_passes_every_replica_computing_a_cold_prompt(
) -> None:
    # A batching engine computes a cold prompt in one step that holds every request there
    # awaiting its first token: a new family goes to a replica computing none of this
    # proxy's, even one holding more in flight (within the bound). A per-slot engine
    # (llama.cpp) keeps counting it twice: there a strict preference measured worse.
    for batching in (False, True):
        ready, a, b, c, (second, third) = three_replicas_one_family(
            "vllm" if batching else "llamacpp", 29, 3)
        a.inflight, a.prefilling = 1, 1  # its cold prompt computing
        b.inflight, c.inflight = 3, 6  # the bound (the mean + 1): 4, so c is out
        # a: 2 counted in the order, b: 3 (no cold prompt), c: over the bound.
        assert ready.choose(None, Req(second)) is (b if batching else a)
        # Every replica within the bound computing one: the load decides again.
        forget_families(ready)
        b.prefilling = 1
        assert ready.choose(None, Req(third)) is a


def test_on_batching_engines_a_new_family_goes_where_the_cold_prompts_computing_are_shortest(
) -> None:
    # A cold prompt's step lasts as long as the prompt: with every replica computing one,
    # the next new family waits least behind the fewest bytes of them (no sharing: the
    # simulator's prompts of 300-900 words), not behind the fewest requests.
    for batching in (False, True):
        ready, a, b, c, (second, third, fourth) = three_replicas_one_family(
            "vllm" if batching else "llamacpp", 37, 4)
        a.inflight, a.prefilling, a.prefill_bytes = 3, 1, 5_000  # one long prompt
        b.inflight, b.prefilling, b.prefill_bytes = 2, 1, 1_500  # one short prompt
        c.inflight = 9  # the bound (the mean + 1): 5, so c is out
        # Counted in requests (per-slot engines), b holds fewer: 3 against 4.
        assert ready.choose(None, Req(second)) is b
        # In bytes (batching engines), b computes fewer too: b again, whatever its load.
        forget_families(ready)
        b.inflight = 4
        assert ready.choose(None, Req(third)) is (b if batching else a)
        # Within the same KiB the load decides again.
        forget_families(ready)
        b.prefill_bytes = 5_100
        assert ready.choose(None, Req(fourth)) is a


def test_a_new_family_counts_the_other_proxies_cold_prompts_once() -> None:
    # Each of 4 proxies saw only its own cold prompts and placed new families onto a
    # replica another proxy was filling: their cold prompts there (announced with the
    # fleet's loads) count one each in a new family's order (this proxy's count two).
    ready, a, b, c, (second, third) = three_replicas_one_family("vllm", 31, 3)
    a.inflight, b.inflight, c.inflight = 1, 0, 2  # the bound: 2, so c is out
    b.peer_prefilling = 1  # another proxy's cold prompt computing there: 1 against 1
    assert ready.choose(None, Req(second)) is b  # the tie: the fewest families
    forget_families(ready)
    b.peer_prefilling = 2
    assert ready.choose(None, Req(third)) is a  # 1 against 2


def test_an_idle_fleet_places_a_new_family_by_recent_traffic_not_by_a_request_in_flight(
) -> None:
    # 4 llama.cpp servers at 1.5 arrivals/s: a new family went to the server of the
    # hottest one because the other servers with room each had a request in flight (or
    # the rendezvous order broke a tie between idle ones), and the two shared 2 slots.
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:3]))
    hot, warm, c1, c2, new, seen, later = bodies(7, seed=27)
    a = ready.choose(None, Req(hot))
    assert a is not None
    for _ in range(20):  # the hot family's traffic
        assert ready.choose(None, Req(hot)) is a
    b = ready.choose(None, Req(warm))
    assert b is not None and b is not a  # the least recent traffic, whatever the hash
    assert ready.choose(None, Req(warm)) is b and ready.choose(None, Req(warm)) is b
    c = next(r for r in ready.replicas if r not in (a, b))
    assert ready.choose(None, Req(c1)) is c and ready.choose(None, Req(c2)) is c
    # Traffic a 21, b 3, c 2, and one request in flight on b: the fleet still idles (1 <
    # 3 replicas). By load and families for capacity (b over the bound of 1, a with 1
    # family of 4 against c's 2) the hot family's replica would take it; by traffic, c.
    b.inflight = 1
    assert ready.choose(None, Req(new)) is c
    # Other proxies' requests count too (2 on a as the in-flight hash showed them): 3 in
    # flight over 3 replicas is not idle, and the load bound and families order again.
    a.peer_seen = 2
    assert ready.choose(None, Req(seen)) is a
    a.peer_seen = 0
    # A busy fleet (4 in flight over 3 replicas): the least loaded again, whatever its
    # traffic.
    b.inflight, c.inflight = 2, 2
    assert ready.choose(None, Req(later)) is a


def test_an_idle_fleet_is_ordered_by_the_other_proxies_traffic_too() -> None:
    # 4 proxies: each routes ~1/4 of the requests, so its own traffic is a noisy quarter
    # of the fleet's. The others' (from the in-flight hash) is added to it.
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:3]))
    table = ready.policy.placement  # type: ignore[attr-defined]
    a, b, c = ready.replicas
    first, second = bodies(2, seed=29)
    table.traffic.update({a: 5.0, b: 3.0, c: 0.0})
    # This proxy's traffic alone would pick c; the fleet's says c is the busiest.
    table.set_peer_traffic({c.url: 10.0, a.url: 1.5, "http://127.0.0.1:1": 99.0})
    assert table.peer_traffic == {c: 10.0, a: 1.5}  # a URL not in the set: ignored
    assert ready.choose(None, Req(first)) is b
    # Without the others' counts (none fresh), this proxy's own order again.
    table.set_peer_traffic({})
    assert ready.choose(None, Req(second)) is c
    table.set_peer_traffic({a.url: 1.0, c.url: 2.0})
    table.update([a, b])  # a replica that left takes the others' traffic with it too
    assert table.peer_traffic == {a: 1.0}


def test_an_idle_fleet_counts_the_new_families_other_proxies_just_placed() -> None:
    # 4 proxies on unshared prompts, llama.cpp: the in-flight hash shows another proxy's
    # traffic up to 2 s late, so proxies that each saw one replica with the least traffic
    # sent it their new families within that time (two cold prompts on one server). The
    # other proxy's placement, adopted about 20 ms after it was made, counts at once.
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:3]))
    table = ready.policy.placement  # type: ignore[attr-defined]
    table.refresh(1000.0)
    a, b, c = ready.replicas
    first, second = bodies(2, seed=33)
    table.traffic.update({a: 2.0, b: 2.6, c: 3.0})
    table.adopt([(7, a.url, 999.9), (8, c.url, 1000.0 - PEER_FRESH - 0.1),  # the 2nd: old
                 (11, c.url, 1059.0)])  # a clock far ahead: would stay counted a minute
    assert table.peer_fresh == {a: 1}
    assert ready.choose(None, Req(first)) is b  # a 3.0, b 2.6, c 3.0
    fid = family_of(ready, first)
    table.adopt([(fid, b.url, 1000.0)])  # this proxy's own placement read back
    table.adopt([(7, c.url, 1000.0)])  # a family it knows, moved: no new cold prompt
    assert table.peer_fresh == {a: 1}
    # PEER_FRESH later the in-flight hash shows it: the count is let go. Traffic 2.5 s
    # later: a 1.89, b 3.40, c 2.83.
    table.refresh(1000.0 + PEER_FRESH + 0.5)
    assert table.peer_fresh == {}
    assert ready.choose(None, Req(second)) is a
    table.adopt([(9, c.url, table.now)])
    table.update([a, b])  # a replica that left takes its count with it
    assert table.peer_fresh == {}
    # Batching engines do not order a new family by traffic: nothing is counted.
    with_slots(ready, 4, "vllm")
    table.adopt([(10, a.url, table.now)])
    assert table.peer_fresh == {}


def test_batching_engines_place_a_new_family_by_load_on_an_idle_fleet_too() -> None:
    # A batching engine (vLLM's engine view) takes a second family's requests into the
    # same batch: a new family goes by the load bound even on an idle fleet, and no
    # traffic is counted (the simulator measured traffic first worse there).
    hot, warm, new = bodies(3, seed=27)
    engines = {False: "llamacpp", True: "vllm"}
    for batching in (False, True):
        ready = ReadySet()
        ready.apply(snapshot(1, *URLS[:2]))
        with_slots(ready, 4, engines[batching])
        a = ready.choose(None, Req(hot))
        assert a is not None
        for _ in range(20):
            assert ready.choose(None, Req(hot)) is a
        b = ready.choose(None, Req(warm))
        assert b is not None and b is not a
        b.inflight = 1  # over the new-family bound; 1 in flight over 2 replicas: idle
        assert ready.choose(None, Req(new)) is (a if batching else b)
        traffic = ready.policy.placement.traffic  # type: ignore[attr-defined]
        assert (traffic[a] == 0) is batching


def test_recent_traffic_halves_every_half_life() -> None:
    table = PlacementTable()
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:2]))
    table.update(ready.replicas)
    table.refresh(1000.0)
    a, b = ready.replicas[0], ready.replicas[1]
    table.traffic[a] = 8.0
    table.refresh(1000.0 + TRAFFIC_HALF_LIFE)
    assert table.traffic == {a: 4.0, b: 0.0}
    table.refresh(1000.0 + 3 * TRAFFIC_HALF_LIFE)
    assert table.traffic[a] == pytest.approx(1.0)
    table.update([b])  # a replica that left takes its traffic with it
    assert table.traffic == {b: 0.0}


def test_a_full_replica_takes_no_new_family_while_another_has_room() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:2]))
    with_slots(ready, 1)
    first, second = bodies(2, seed=31)
    a = ready.choose(None, Req(first))
    assert a is not None
    b = next(r for r in ready.replicas if r is not a)
    a.inflight = 1
    b.prefilling = b.inflight = 1  # busier (a cold prefill counts twice), but it has room
    assert ready.choose(None, Req(second)) is b


def spilled_family(seed: int = 41, *, answered: bool = True
                   ) -> tuple[ReadySet, bytes, Replica, Replica, Family]:
    """4 replicas at epsilon 0.5; a family placed, then its home saturated (in flight 6
    of 6 over 4: bound ceil(1.5 x 7 / 4) = 3) and its next request spilled (`answered`:
    its first byte came): (ready set, body, home, spill replica, the family's entry)."""
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(epsilon=0.5, placement="capacity")))
    body = bodies(1, seed=seed)[0]
    home = ready.choose(None, Req(body))
    assert isinstance(home, Replica)
    home.inflight = 6
    first = Req(body)
    spill = ready.choose(None, first)
    assert isinstance(spill, Replica) and spill is not home
    fam = ready.policy.placement.families[family_of(ready, body)]  # type: ignore[attr-defined]
    assert first.cold and first.warms is fam and fam.warming is spill
    if answered:
        fam.warming = None  # what Exchange.prefilled does
    return ready, body, home, spill, fam


def moved_family() -> tuple[ReadySet, bytes, Replica, Replica, Family, Replica, Replica]:
    """spilled_family(), then its secondary above the mean: the overflow moved to the
    least loaded other replica, warming (it computes the prompt first), the one it left
    the former secondary: (ready set, body, home, former, family, new secondary, the
    other replica, 1 in flight)."""
    ready, body, home, spill, fam = spilled_family()
    others = [r for r in ready.replicas if r not in (home, spill)]
    home.inflight, spill.inflight, others[0].inflight = 6, 3, 1
    moved = ready.choose(None, Req(body))
    assert moved is others[1] and fam.secondary is moved and fam.warming is moved
    assert fam.former is spill
    return ready, body, home, spill, fam, moved, others[0]


def test_a_saturated_family_spills_to_one_more_replica_and_comes_back() -> None:
    ready, body, home, spill, fam = spilled_family()
    assert fam.primary is home and fam.secondary is spill
    # While home is saturated the family keeps to its one spill replica (cached there).
    spill.inflight = 1
    for _ in range(5):
        assert ready.choose(None, Req(body)) is spill
    assert ready.policy.routed[spill.url][SPILL] == 6  # type: ignore[attr-defined]
    home.inflight = 0
    assert ready.choose(None, Req(body)) is home
    # Both saturated: the overflow moves to a third replica, the home stays the home.
    home.inflight = spill.inflight = 6
    third = ready.choose(None, Req(body))
    assert third is not None and third not in (home, spill)
    assert fam.primary is home and fam.secondary is third


def test_a_familys_overflow_goes_where_the_fleet_is_least_loaded() -> None:
    # Each of N proxies counts ~1/N of the fleet's requests: on its own counts, one of 4
    # proxies sent the hottest family's overflow to a replica holding three other
    # families while another idled. A first spill is one decision the other proxies
    # adopt, so it is ordered by the fleet's load as the in-flight hash showed it (a
    # second old, `peer_seen`) plus this proxy's live counts.
    _, body, home, spill, _ = spilled_family()  # where this proxy's counts alone send it
    options = cold_options(epsilon=0.5, placement="capacity")
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=options))
    by_url = {r.url: r for r in ready.replicas}
    assert ready.choose(None, Req(body)) is by_url[home.url]
    by_url[spill.url].peer_seen = 10  # the other proxies have 10 in flight there
    by_url[home.url].inflight = 6
    first = ready.choose(None, Req(body))
    assert first is not None and first.url not in (home.url, spill.url)
    # A new family is placed on this proxy's live counts alone (test_peer_inflight.py,
    # test_a_new_prefix_is_judged_on_this_proxys_own_live_counts).


def test_the_overflow_waits_at_the_primary_while_a_new_secondary_computes_the_prompt() -> None:
    ready, body, home, spill, fam = spilled_family(answered=False)
    assert fam.secondary is spill and fam.warming is spill
    # Until that request's first byte: a second one there would compute the prompt again.
    again = Req(body)
    assert ready.choose(None, again) is home and not again.cold and again.warms is None
    fam.warming = None  # the first byte (Exchange.prefilled)
    assert ready.choose(None, Req(body)) is spill
    # An answer lost on the way (or a replica stuck on it): the table's refresh lets go
    # once the wait is WARM_HOLD old, not before (a cold prompt may take seconds).
    home.inflight, spill.inflight = 6, 6
    third = ready.choose(None, Req(body))
    assert third not in (None, home, spill) and fam.warming is third
    assert ready.choose(None, Req(body)) is home
    table = ready.policy.placement  # type: ignore[attr-defined]
    table.refresh(table.now + WARM_HOLD - 0.5)
    assert ready.choose(None, Req(body)) is home
    table.refresh(table.now + 1.0)
    assert ready.choose(None, Req(body)) is third


def test_while_a_moved_overflow_warms_it_waits_at_the_former_secondary() -> None:
    # The overflow moved off a secondary above the mean to a cold replica: while that one
    # computes the prompt, the overflow waited at the primary, over its bound (a trace of
    # overload seed 1 with 4 proxies: 0.7 s with the primary at 37-40 in flight, the
    # former secondary at 27). The former still holds the prompt: it waits there while
    # that is within the bound.
    ready, body, home, spill, fam, moved, _ = moved_family()
    again = Req(body)
    assert ready.choose(None, again) is spill  # within the bound: ceil(1.5 x 12 / 4) = 5
    assert not again.cold and again.warms is None
    assert (fam.secondary, fam.former, fam.warming) == (moved, spill, moved)  # no swap
    table = ready.policy.placement  # type: ignore[attr-defined]
    table.refresh(table.now + 1.5)
    fam.former_used = table.now - 1.5  # its last use before the move
    assert ready.choose(None, Req(body)) is spill
    assert fam.former_used == table.now  # used: warm while the hold lasts
    spill.inflight = 5  # at the bound: the primary, as before
    assert ready.choose(None, Req(body)) is home
    spill.inflight = 3
    fam.former_used = table.now - 3  # nothing went there for 3 s: its copy may be gone
    assert ready.choose(None, Req(body)) is home
    fam.former_used = table.now
    spill.left_at = 1.0  # gone
    assert ready.choose(None, Req(body)) is home
    spill.left_at = None
    assert ready.choose({spill}, Req(body)) is home  # excluded (it failed this request)
    fam.warming = None  # the first answer came: the new secondary takes the overflow
    assert ready.choose(None, Req(body)) is moved


def test_the_overflow_leaves_a_secondary_above_the_mean_for_the_least_loaded() -> None:
    ready, body, home, spill, fam = spilled_family()
    others = [r for r in ready.replicas if r not in (home, spill)]
    # The secondary at the mean (total 8: 8 // 4 + 1 = 3 is "above", 2 is not): kept.
    home.inflight, spill.inflight = 6, 2
    assert ready.choose(None, Req(body)) is spill
    # Above the mean though within the bound (ceil(1.5 x 11 / 4) = 5 > 3): the least
    # loaded of the others takes the overflow and is the secondary from now on.
    spill.inflight, others[0].inflight = 3, 1
    moved = ready.choose(None, Req(body))
    assert moved is others[1]
    assert fam.primary is home and fam.secondary is others[1]
    # The home within its bound again: the family goes home, whatever its secondary.
    home.inflight = 0
    assert ready.choose(None, Req(body)) is home


def test_with_the_fleets_counts_the_secondary_is_judged_on_them_too() -> None:
    # --fleet-load: each replica's load counts the other proxies' in flight
    # (`peer_inflight`) and the margin is the fleet's (set_proxies(1): no slack). On this
    # proxy's own counts (~1/4 of the fleet's, with 4 proxies) the secondary looks above
    # the mean: 3 of 6 + 3 + 1 + 0 (10 // 4 + 1 = 3). On the fleet's it holds far below it.
    ready, body, home, spill, fam = spilled_family()
    others = [r for r in ready.replicas if r not in (home, spill)]
    home.inflight, spill.inflight, others[0].inflight, others[1].inflight = 6, 3, 1, 0
    home.peer_inflight, others[0].peer_inflight, others[1].peer_inflight = 10, 6, 6
    # The fleet: 16 (over the bound, ceil(1.5 x 33 / 4) = 13), 3, 7, 6: mean 32 // 4 + 1
    # = 9. The overflow stays on its warm secondary (judged on this proxy's own counts,
    # it went to a cold replica).
    kept = Req(body)
    assert ready.choose(None, kept) is spill
    assert fam.secondary is spill and fam.warming is None and not kept.cold
    # Above the fleet's mean (10 of 16 + 10 + 7 + 6: 39 // 4 + 1 = 10): the least loaded
    # on the fleet's counts takes it, and computes the prompt first.
    spill.peer_inflight = 7
    moved = ready.choose(None, Req(body))
    assert moved is others[1] and fam.secondary is moved and fam.warming is moved


def test_the_overflow_goes_back_to_its_former_secondary_warm_before_a_cold_replica() -> None:
    # The secondary above the mean: the overflow moves to the least loaded other one,
    # which computes the prompt first (warming); the one it left is the former secondary.
    ready, body, _, spill, fam, moved, idle = moved_family()
    fam.warming = None  # its first answer came
    # Now the new secondary is above the mean and the former one is not: the overflow goes
    # back there (it holds the prompt: no warming hold, no cold prefill), not to the idle
    # replica the least-loaded order would pick (`idle`, 0 in flight).
    moved.inflight, spill.inflight, idle.inflight = 4, 1, 0
    back = Req(body)
    assert ready.choose(None, back) is spill
    assert fam.secondary is spill and fam.former is moved and fam.warming is None
    assert not back.cold and back.warms is None
    assert ready.policy.placement.spill_outbox[-1] == (  # type: ignore[attr-defined]
        family_of(ready, body), spill.url, True)  # shared: the other proxies follow
    # Both above the mean: a cold replica after all (and it warms first).
    spill.inflight = 4
    third = ready.choose(None, Req(body))
    assert third is idle and fam.warming is third and fam.former is spill
    # A former secondary unused for a quarter of the TTL is forgotten, like a secondary.
    table = ready.policy.placement  # type: ignore[attr-defined]
    table.refresh(table.now + table.ttl / 4 + 1)
    assert fam.former is None and fam.secondary is None


def test_a_move_back_to_the_former_secondary_on_another_proxy_holds_no_overflow() -> None:
    table = PlacementTable()
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4]))
    table.update(ready.replicas)
    table.refresh(1000.0)
    a, b, c = ready.replicas[:3]
    table.adopt([(7, a.url, 999.0)])
    table.adopt_spills([(7, b.url, 999.0)])  # another proxy's first spill: warming there
    fam = table.families[7]
    assert fam.secondary is b and fam.warming is b
    fam.warming = None  # its first answer came (adopt_warm)
    table.adopt_spills([(7, c.url, 999.5)])  # moved to c: cold, the overflow waits
    assert (fam.secondary, fam.former, fam.warming) == (c, b, c)
    fam.warming = None
    table.adopt_spills([(7, b.url, 999.8)])  # moved back to b: warm, nothing waits
    assert (fam.secondary, fam.former, fam.warming) == (b, c, None)


def test_a_family_routed_on_its_known_prefixes_stays_placed() -> None:
    # Nearly every request of a family goes through the longest-prefix memory, which
    # returned before the placement was asked: the family's entry aged as if unused, was
    # dropped after the TTL (its replica's capacity counted free) and placed anew.
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(placement="capacity",
                                                             placement_ttl=10.0)))
    table = ready.policy.placement  # type: ignore[attr-defined]
    body = bodies(1, seed=43)[0]
    home = ready.choose(None, Req(body))
    fid = family_of(ready, body)
    for _ in range(4):  # 20 s of use, 5 s apart: twice the TTL
        table.refresh(table.now + 5.0)
        assert ready.choose(None, Req(body)) is home
    table.refresh(table.now + 5.0)
    assert fid in table.families and table.placed[home] == 1


def test_a_family_whose_replica_left_moves_and_stays_moved() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4]))
    body = bodies(1, seed=51)[0]
    home = ready.choose(None, Req(body))
    assert home is not None
    rest = [u for u in URLS[:4] if u != home.url]
    ready.apply(snapshot(2, *rest))
    moved = ready.choose(None, Req(body))
    assert moved is not None and moved.url in rest
    for r in ready.replicas:
        r.inflight = 1 if r is moved else 0  # no longer the least loaded: still its home
    assert ready.choose(None, Req(body)) is moved


def test_unused_families_and_spills_expire() -> None:
    table = PlacementTable(ttl=100.0)
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:2]))
    table.update(ready.replicas)
    table.refresh(1000.0)
    a, b = ready.replicas[0], ready.replicas[1]
    table.add(1, a)
    table.add(2, b)
    table.families[1].secondary = b
    table.families[1].secondary_used = 1000.0
    table.families[2].used = 1060.0
    assert table.refresh(1050.0) == 0 and table.families[1].secondary is None  # 25 s unused
    assert table.refresh(1101.0) == 1 and list(table.families) == [2]
    assert table.placed[a] == 0 and table.placed[b] == 1


def test_adopted_placements_win_and_unknown_replicas_are_skipped() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:2]))
    table = ready.policy.placement  # type: ignore[attr-defined]
    table.refresh(1000.0)
    body = bodies(1, seed=61)[0]
    mine = ready.choose(None, Req(body))
    assert mine is not None
    fid = family_of(ready, body)
    assert table.outbox == [(fid, mine.url)]  # queued for the other proxies
    other = next(r for r in ready.replicas if r is not mine)
    skipped = table.adopt([(fid, other.url, 999.0), (7, "http://evil:1", 999.0),
                           (8, other.url, 1.0)])  # the last one: long expired
    assert skipped == 1
    assert ready.choose(None, Req(body)) is other  # the shared placement wins
    assert 8 not in table.families and table.placed[mine] == 0


def test_placement_options_are_checked() -> None:
    assert PrefixOptions().placement == "auto"
    static = ReadySet()
    static.apply(prefix_snapshot(1, *URLS[:4]))  # auto without a Redis source: rendezvous
    assert static.policy.placement is None  # type: ignore[attr-defined]
    for bad in ({"placement": "hash"}, {"replica_families": -1}, {"placement_ttl": 0.0}):
        with pytest.raises(ValueError, match=r"prefix\.(placement|replica_families)"):
            PrefixOptions(**bad)  # type: ignore[arg-type]
    assert PrefixRouting(placement="rendezvous").placement == "rendezvous"


def test_spills_are_queued_and_shared_ones_adopted_within_their_bounds() -> None:
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(epsilon=0.5, placement="capacity")))
    table = ready.policy.placement  # type: ignore[attr-defined]
    table.refresh(1000.0)  # ttl 300: a secondary lives 75 s
    body = bodies(1, seed=71)[0]
    home = ready.choose(None, Req(body))
    assert home is not None
    fid = family_of(ready, body)
    home.inflight = 6
    spill = ready.choose(None, Req(body))
    assert spill is not None and spill is not home
    assert table.spill_outbox == [(fid, spill.url, False)]  # a first spill: first writer wins
    table.families[fid].warming = None  # its first byte came (Exchange.prefilled)
    home.inflight = spill.inflight = 6
    third = ready.choose(None, Req(body))
    assert third is not None and third not in (home, spill)
    assert table.spill_outbox[1:] == [(fid, third.url, True)]  # a move: overwrites
    fam = table.families[fid]
    fourth = next(r for r in ready.replicas if r not in (home, spill, third))
    skipped = table.adopt_spills([
        (fid, "http://evil:1", 999.0),  # not in the set: counted
        (fid, fourth.url, 1e12),  # from the future: counted
        (fid, fourth.url, 900.0),  # older than a secondary lives
        (fid, home.url, 999.0),  # the family's own primary
        (12345, fourth.url, 999.0),  # a family not placed here
    ])
    assert skipped == 2 and fam.secondary is third and 12345 not in table.families
    assert table.adopt_spills([(fid, fourth.url, 990.0)]) == 0
    assert fam.secondary is fourth and fam.secondary_used == 1000.0  # used here since
    # The shared secondary left the set: dropped, and an entry naming it is not followed.
    ready.apply(snapshot(2, *[r.url for r in ready.replicas if r is not fourth],
                         options=cold_options(epsilon=0.5, placement="capacity")))
    assert fam.secondary is None
    assert table.adopt_spills([(fid, fourth.url, 999.0)]) == 1 and fam.secondary is None


def turn_fleet() -> tuple[ReadySet, Any, PlacementTable]:
    """4 replicas at epsilon 1.0 with placement, the table's clock at 1000: (ready set,
    policy, table)."""
    ready = ReadySet()
    ready.apply(snapshot(1, *URLS[:4], options=cold_options(epsilon=1.0, placement="capacity")))
    table = ready.policy.placement  # type: ignore[attr-defined]
    table.refresh(1000.0)
    return ready, ready.policy, table


def test_spilled_turns_are_queued_and_learnt_first_writer_wins() -> None:
    ready, policy, table = turn_fleet()
    system = "System prompt 81. " + LONG
    home = ready.choose(None, Req(chat(system, "q")))
    assert home is not None and table.turn_outbox == []  # at home: nothing to tell
    home.inflight = 6
    turn = chat(system, "A question long enough to fill blocks of its own. " * 12)
    spill = ready.choose(None, Req(turn))
    assert spill is not None and spill is not home
    key = policy.key_of(Req(turn))  # type: ignore[attr-defined]
    assert table.turn_outbox == [(key[-2], spill.url)]
    lru = policy._lru  # type: ignore[attr-defined]
    other = next(r for r in ready.replicas if r not in (home, spill))
    skipped = policy.learn([  # type: ignore[attr-defined]
        (key[-2], other.url, 999.0),  # known here: first writer wins
        (77, other.url, 999.0),
        (78, other.url, 900.0),  # older than a secondary lives (75 s)
        (79, "http://evil:1", 999.0),
    ])
    assert skipped == 1
    assert lru[key[-2]] is spill and lru[77] is other and 78 not in lru and 79 not in lru


def test_turns_that_follow_a_conversation_to_the_secondary_keep_it_warm() -> None:
    # A conversation that spilled continues at the secondary through the longest-prefix
    # memory, which returned before the placement was asked: the secondary aged as if
    # unused and was dropped after ttl / 4 while its turns kept it warm, and the family's
    # next overflow went to a new, cold replica.
    ready, _, table = turn_fleet()
    system = "System prompt 83. " + LONG
    home = ready.choose(None, Req(chat(system, "q")))
    assert home is not None
    home.inflight = 6
    turn = chat(system, "A question long enough to fill blocks of its own. " * 12)
    spill = ready.choose(None, Req(turn))
    assert spill is not None and spill is not home
    fam = table.families[family_of(ready, turn)]
    fam.warming = None
    home.inflight = 0
    for _ in range(4):  # 120 s of turns, 30 s apart: past a secondary's 75 s
        table.refresh(table.now + 30.0)
        assert ready.choose(None, Req(turn)) is spill
    table.refresh(table.now + 30.0)
    assert fam.secondary is spill
    table.refresh(table.now + table.ttl / 4)  # then nothing for 75 s: dropped
    assert fam.secondary is None


def test_a_spill_announces_no_block_that_other_requests_share() -> None:
    # Under a short question the last block but one is the system prompt's: announced, it
    # taught every other proxy's longest-prefix memory that the whole family lives at the
    # secondary (first writer wins), and one of 4 proxies sent its whole share of the
    # hottest family there for the rest of the run (the simulator's 24 shared prompts).
    ready, policy, table = turn_fleet()
    system = "System prompt 85. " + LONG
    first = chat(system, "Why?")
    home = ready.choose(None, Req(first))
    assert home is not None
    home.inflight = 6
    short = chat(system, "How?")
    shared = policy.key_of(Req(short))  # type: ignore[attr-defined]
    assert shared[-2] in policy.key_of(Req(first))  # type: ignore[attr-defined]
    spill = ready.choose(None, Req(short))
    assert spill is not None and spill is not home
    assert table.turn_outbox == []  # the family's own block: not a turn of its own
    table.families[shared[0]].warming = None  # its first answer came
    turn = chat(system, "A question long enough to fill blocks of its own. " * 12)
    assert ready.choose(None, Req(turn)) is spill
    own = policy.key_of(Req(turn))  # type: ignore[attr-defined]
    assert table.turn_outbox == [(own[-2], spill.url)]  # a block no request had: told


async def test_without_a_shared_placement_task_the_sweeper_refreshes_the_table() -> None:
    """No Redis source (or Redis down): nothing else advances the table's clock, so a
    wait for a lost answer, secondaries and families would never expire."""
    ready, body, home, spill, fam = spilled_family(answered=False)
    table = ready.policy.placement  # type: ignore[attr-defined]
    table.now = fam.warming_at = time.time() - WARM_HOLD - 1  # its last refresh: long ago
    ctx = ServerContext(ProxyConfig(), ready, Stats(), b"http")
    for _ in range(STREAM_SWEEP_EVERY):  # a second of sweeper ticks
        ctx.tick()
    assert table.now >= time.time() - 5 and fam.warming is None
    home.inflight, spill.inflight = 6, 0
    assert ready.choose(None, Req(body)) is spill
    # A table refreshed within PLACEMENT_STALE is left to whoever refreshes it.
    before = table.now = time.time() - PLACEMENT_STALE / 2
    for _ in range(STREAM_SWEEP_EVERY):
        ctx.tick()
    assert table.now == before


def test_a_spill_whose_first_answer_came_is_announced_once() -> None:
    ready, body, home, spill, fam = spilled_family(answered=False)
    table = ready.policy.placement  # type: ignore[attr-defined]
    fid = family_of(ready, body)
    assert table.take_warmed() == []  # still computing the prompt: the others wait
    fam.warming = None  # its first byte (Exchange.prefilled)
    assert table.take_warmed() == [(fid, spill.url)]
    assert table.take_warmed() == []
    # A family dropped while it waited (evicted, expired) is let go by the hold's bound.
    home.inflight, spill.inflight = 6, 6
    third = ready.choose(None, Req(body))
    assert third not in (None, home, spill) and fam.warming is third
    del table.families[fid]
    table.refresh(table.now + 1.0)
    assert table.take_warmed() == []
    table.refresh(table.now + WARM_HOLD)
    assert table.take_warmed() == [(fid, third.url)] and not table.warming_spills
