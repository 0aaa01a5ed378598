"""Where each prompt family lives: placement by load and free cache capacity.

A *family* is a routing key's first element (the first block's chain hash, or a
session's hash): the requests the `prefix` policy sends to one replica's cache.
The rendezvous order alone (proxy/prefix.py) is blind to load and to how many
families a replica can keep: on 4 llama.cpp servers with 2 slots each it put 3
of 8 families on one server, whose slots then evicted each other. This table
decides instead, for a family it does not know:

1. among the replicas not excluded and still in the set, those within the
   load bound (the caller's: the mean in flight for a new family, on this proxy's
   own counts; for a known family's overflow, `fleet`, the load counts the other
   proxies' in-flight requests too);
2. of these, one with free cache capacity (families placed there < its
   capacity: llama.cpp's slots from the engine view, else the KV capacity in
   tokens over the key window's tokens, else the configured default);
3. on engines with one cache per slot (anything but batching engines only: llama.cpp,
   or no engine view), while the fleet is nearly idle (fewer requests in flight and
   waiting in engines than replicas: this proxy's counts and `peer_seen`, the other
   proxies' as the in-flight hash showed them a second ago), the least recent traffic
   first (`traffic`: the requests this proxy routed to each replica, halved every
   TRAFFIC_HALF_LIFE, plus `peer_traffic`, the other proxies' as their in-flight entries
   showed it a second ago: each of 4 proxies sees a quarter of the fleet's traffic; shared,
   4 proxies on real llama.cpp servers took 93 ms of mean TTFT against 97, and 3 % fewer
   prompt tokens, over 12 runs; and `peer_fresh`, the new families they placed in the
   last PEER_FRESH seconds, adopted from the shared placement about 20 ms after: the hash
   shows them up to 2 s late, and meanwhile the proxies that saw one replica with the
   least traffic sent it their new families too, two cold prompts on one server; on
   unshared prompts 4 proxies' requests over 1.5 x the median TTFT fell 32 -> 17 of 352,
   p99 789 -> 562 ms, over 6 paired runs), the load bound of 1 not applied: whether a
   replica has a request in flight at that moment (0 or 1) is noise, where the traffic
   of the families already there says which replica the new one would share slots with.
   On 4 llama.cpp servers with 2 slots at 1.5 arrivals/s the two hottest of 8 families
   landed on one server (51 of 90 requests) when the rendezvous order broke a tie
   between idle servers; ordered by traffic, mean TTFT fell 6 % (74 -> 70 ms over 14
   runs, better in 10, worse in 1) and prompt tokens computed 5 %, with 1 proxy and with
   4 (bench/README.md, "A new family on an idle llama.cpp fleet goes where the traffic
   is least"). Batching engines (vLLM, SGLang, TGI) take a second family into the same
   batch, and there the simulator measured it worse (6 cells of 18 slower, 3 faster):
   their new families keep the order below;
   then the lowest load: this proxy's in flight + engine queue, where a request it sent
   as a predicted miss that has no response byte yet (`prefilling`, counted by the
   exchange) counts twice. A cold prompt of a thousand tokens holds its replica's batch
   for a while, and two new families placed on one replica 40 ms apart made the second,
   and every request behind it, wait (the simulator's p99). Twice, not "avoid at any
   load": a strict preference measured worse on real llama.cpp servers, whose requests
   wait cold in the engine's queue for seconds (bench/README.md). On batching engines
   only it is strict for a new family (not a known family's overflow): a replica
   computing a cold prompt of this proxy's comes after every one that is not, before
   the load, and among those computing one, the fewest bytes of them first (the
   requests' bodies, in KiB: `prefill_bytes`). There the prompt is one engine step that
   holds every request awaiting its first token, as long as the prompt is long; with
   prompts shared by nobody every replica computes one most of the time, and their
   count says less than their length (bench/README.md, "Cold prompts weighed by their
   length"). On the simulator with 1 proxy, shared prompts' mean TTFT fell 7-11 % in
   8 of 9 paired runs, and the cells meeting the goal against the peers in the same runs
   went from 7 of 15 to 10 (bench/README.md, "A new family passes a replica computing a
   cold prompt, on batching engines"). The other proxies' cold prompts there
   (`peer_prefilling`, announced with the fleet's loads about 20 ms late:
   proxy/sources/placement.py) count once in a new family's load, not in the strict
   order: each of 4 proxies saw only its own, and placed new families on replicas the
   others were filling. Counted strictly they narrowed new families onto the few
   replicas computing none (shared prompts, seed 2: +25 % mean TTFT in every round);
   counted once, 4 proxies' mean TTFT summed over 15 cells fell 3-5 % in two rounds
   (bench/README.md, "The other proxies' cold prompts in a new family's order");
4. then the fewest families for its capacity, then (per-slot engines) the least recent
   traffic; the family's rendezvous order breaks the remaining ties (so proxies with the
   same view decide the same).

A known family goes to its primary while that is within the (1 + epsilon)
bound (and `spill_margin` above the mean: PrefixPolicy._capacity), else to its
secondary while that is at or below the mean in flight (a hot family spills to
one more replica only when its own is saturated), else to its former secondary (the
one the overflow last moved off: it still holds the prompt) while that is, else to
a new secondary chosen as above, its load counting the other proxies' in flight as the
in-flight hash showed it a second ago (`peer_seen`: this proxy's own counts are ~1/N of
the fleet's, and a first spill is one decision the others adopt, so it cannot herd
them); the overflow moves to the least loaded, and the two swap when it goes back to
the former. A family whose primary and secondary both hold more than the mean, while
another replica holds less (by 2 in flight each, on the fleet's counts), gets that replica
as a third copy while the caches are at most half full (`Family.third`, unshared: each
proxy finds its own); once the primary is above the mean a request goes to whichever
warm copy holds the fewest (PrefixPolicy._warm_copy). While the first request this proxy spilled
to a new secondary has no response byte yet (`Family.warming`: that replica is
still computing the prompt), the overflow waits at the former secondary while that is
within the bound and was used in the last 2 s (it holds the prompt), else at the
primary: on an engine with one cache per slot (llama.cpp) a second request there
would compute the prompt again, both stalling it (vLLM would match the second once the
first is scheduled, so there the wait costs little: bench/README.md). With shared
placement the other proxies wait for it too (`adopt_spills`, `adopt_warm`); a wait
ends after WARM_HOLD at the latest. A primary that left the set is replaced (the
family moves).
Secondaries unused for `ttl / 4` and families unused for `ttl` are dropped by
`refresh()` (called off the request path about once a second: by the shared-placement
task, else by the sweeper, ReadySet.refresh_placement); the table
holds at most `max_families` (oldest use first out).

Shared placement (proxy/sources/redis.py): every family this proxy placed is
queued in `outbox` (bounded); the source publishes them first-writer-wins and
`adopt()`s what the other proxies placed, so all proxies converge on one
primary per family. The secondaries likewise: a spill this proxy chose is
queued in `spill_outbox` (a first spill is published first-writer-wins, a
moved overflow overwrites) and `adopt_spills()` takes the shared one, so a hot
family spills to one replica fleet-wide, not one per proxy. A request that
spilled queues a deep block of its key in `turn_outbox`: the source announces it and
the other proxies' longest-prefix memories learn it (`PrefixPolicy.learn`), so
a conversation's next turn follows it to the spill replica on any proxy.
Without Redis the table is this proxy's own decisions.
Everything here is synchronous and allocation-light: a known family costs one
dict lookup and a move_to_end; a new one a walk over the replicas.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from proxy.interfaces import ReplicaView
from proxy.wire.engines import batching_only

DEFAULT_CAPACITY = 4  # families a replica holds when neither engine nor config says
DEFAULT_TTL = 300.0  # s; about an engine's prompt-cache lifetime under load
WARM_HOLD = 5.0  # s; a family's overflow waits for its new secondary's first answer at most
TRAFFIC_HALF_LIFE = 30.0  # s; a replica's recent traffic (PlacementTable.traffic) halves in
PEER_FRESH = 2.0  # s; another proxy's new family counts in `peer_fresh` this long
PREFILL_SHIFT = 10  # cold prompts computing compared in 2**10 request bytes (~256 tokens)
MAX_OUTBOX = 4096


class Family:
    """One family's replicas: `primary` (where it is placed), `secondary` (its spill)."""

    __slots__ = ("former", "former_used", "moved_from", "primary", "secondary",
                 "secondary_used", "third", "third_checked", "third_cold", "third_used", "used",
                 "warming", "warming_at")

    def __init__(self, primary: ReplicaView, now: float) -> None:
        self.primary = primary
        self.secondary: ReplicaView | None = None
        self.used = now
        self.secondary_used = 0.0
        # The secondary before the last move off it (saturated then): it still holds the
        # family's prompt, so the overflow goes back there before a cold replica.
        self.former: ReplicaView | None = None
        self.former_used = 0.0
        # The primary this proxy had before adopting another proxy's: the longest-prefix
        # memory's entries pointing there are stale (proxy/prefix.py skips them).
        self.moved_from: ReplicaView | None = None
        # A secondary just chosen (here, or by another proxy: `adopt_spills`), still
        # computing the family's prompt for the first request sent there: the overflow
        # waits at the primary meanwhile (PrefixPolicy._choose_placed). Cleared at that
        # request's first byte or its end (the exchange here, `adopt_warm` elsewhere), or
        # by refresh() once older than WARM_HOLD (`warming_at`). With warm_copies, a
        # secondary or a third copy whose warm-up has not answered yet (proxy/warmup.py).
        self.warming: ReplicaView | None = None
        self.warming_at = 0.0
        # A third copy sharing a hot family's load with the primary and the secondary
        # (PrefixPolicy._warm_copy); `third_cold`: no request was routed there yet.
        self.third: ReplicaView | None = None
        self.third_used = 0.0
        self.third_cold = False
        self.third_checked = 0.0  # the clock tick a proxy of several last looked for one

    def unlink(self, replica: ReplicaView) -> None:
        """`replica` becomes the primary: it is no longer the secondary, the former or the
        third copy."""
        if self.secondary is replica:
            self.secondary = None
        if self.former is replica:
            self.former = None
        if self.third is replica:
            self.third = None

    def replace_secondary(self, replica: ReplicaView) -> None:
        """`replica` takes the overflow; the secondary it replaces becomes the former one
        (a move back to the former swaps them)."""
        if self.secondary is not None:
            self.former, self.former_used = self.secondary, self.secondary_used
        elif self.former is replica:
            self.former = None
        if self.third is replica:
            self.third = None
        self.secondary = replica


def engine_capacity(replica: ReplicaView, window_tokens: int, default: int) -> int:
    """Families `replica` can keep cached: its engine's slots, else KV tokens / window."""
    engine: Any = getattr(replica, "engine", None)
    if engine is not None:
        slots = engine.slots
        if slots:
            return int(slots)
        kv = engine.kv_capacity_tokens
        if kv:
            return max(1, int(kv) // max(1, window_tokens))
    return default


class PlacementTable:
    """family -> Family, with per-replica family counts; see the module docstring."""

    def __init__(self, *, default_capacity: int = DEFAULT_CAPACITY, window_tokens: int = 4096,
                 ttl: float = DEFAULT_TTL, max_families: int = 16384) -> None:
        self.default_capacity = default_capacity or DEFAULT_CAPACITY
        self.window_tokens = window_tokens
        self.ttl = ttl
        self.max_families = max(1, max_families)
        self.families: OrderedDict[int, Family] = OrderedDict()
        self.placed: dict[ReplicaView, int] = {}
        self.capacity: dict[ReplicaView, int] = {}
        # Families placed over the replicas' summed capacity, at most 1 (refresh_capacity):
        # how full the fleet's caches are; the policy's spill margin grows with it.
        self.fullness = 0.0
        self.by_url: dict[str, ReplicaView] = {}
        # (family, replica URL) placed here and not yet published (drained by the source).
        self.outbox: list[tuple[int, str]] = []
        # (family, secondary URL, moved: it replaced a saturated secondary) likewise.
        self.spill_outbox: list[tuple[int, str, bool]] = []
        # (a deep block of a request that spilled, its replica URL) likewise.
        self.turn_outbox: list[tuple[int, str]] = []
        # family -> (its entry, the new secondary) this proxy spilled to and whose first
        # answer the other proxies wait for (`take_warmed` tells them once it came).
        self.warming_spills: dict[int, tuple[Family, ReplicaView]] = {}
        # A coarse clock, set by refresh(): no clock read on the request path.
        self.now = time.time()
        # Requests this proxy routed to each replica (the policy counts them, per-slot
        # engines only), halved every TRAFFIC_HALF_LIFE by refresh(): an idle fleet's new
        # family goes where it is least.
        self.traffic: dict[ReplicaView, float] = {}
        self._traffic_at = self.now
        # The other proxies' `traffic`, as the in-flight hash showed it a second ago
        # (set_peer_traffic): with it, N proxies order an idle fleet by the fleet's traffic
        # where each alone sees ~1/N of it.
        self.peer_traffic: dict[ReplicaView, float] = {}
        # The new families the other proxies placed in the last PEER_FRESH seconds, per
        # replica (adopt(), per-slot engines only): the in-flight hash shows them in
        # `peer_traffic` up to 2 s late, and 4 proxies that each saw the same replica
        # with the least traffic sent it their new families within that second.
        self.peer_fresh: dict[ReplicaView, int] = {}
        self._fresh: deque[tuple[float, ReplicaView]] = deque()
        # The engine view names batching engines only (refresh_capacity): an idle fleet's
        # new family is placed by load as a busy one's, not by recent traffic.
        self.batching = False

    # -- off the request path -------------------------------------------------------------

    def update(self, replicas: Sequence[ReplicaView]) -> None:
        """A new replica set: families on replicas gone move to their secondary or go."""
        live = set(replicas)
        self.by_url = {r.url: r for r in replicas}
        self.placed = {r: 0 for r in replicas}
        self.traffic = {r: self.traffic.get(r, 0.0) for r in replicas}
        self.peer_traffic = {r: v for r, v in self.peer_traffic.items() if r in live}
        self._fresh = deque(e for e in self._fresh if e[1] in live)
        self.peer_fresh = {r: n for r, n in self.peer_fresh.items() if r in live}
        for fid in list(self.families):
            fam = self.families[fid]
            if fam.secondary is not None and fam.secondary not in live:
                fam.secondary = None
            if fam.former is not None and fam.former not in live:
                fam.former = None
            if fam.third is not None and fam.third not in live:
                fam.third = None
            if fam.primary not in live:
                if fam.secondary is None:
                    del self.families[fid]
                    continue
                fam.primary, fam.secondary = fam.secondary, None
            self.placed[fam.primary] += 1
        self.refresh_capacity()

    def refresh_capacity(self) -> None:
        self.capacity = {r: engine_capacity(r, self.window_tokens, self.default_capacity)
                         for r in self.placed}
        self.batching = batching_only(getattr(r, "engine", None) for r in self.placed)
        total = sum(self.capacity.values())
        self.fullness = min(1.0, sum(self.placed.values()) / total) if total else 0.0

    def set_peer_traffic(self, by_url: Mapping[str, float]) -> None:
        """The other proxies' recent traffic per replica URL (summed; unknown URLs
        ignored)."""
        by = self.by_url
        self.peer_traffic = {by[url]: v for url, v in by_url.items() if url in by}

    def refresh(self, now: float) -> int:
        """Advance the clock, drop stale secondaries and families; returns families dropped."""
        self.now = now
        elapsed = now - self._traffic_at
        self._traffic_at = now  # a clock set back (a test's) starts the halving anew
        if elapsed > 0:
            decay = 0.5 ** (elapsed / TRAFFIC_HALF_LIFE)
            traffic = self.traffic
            for r in traffic:
                traffic[r] *= decay
        fresh, fresh_cut = self._fresh, now - PEER_FRESH
        while fresh and fresh[0][0] < fresh_cut:
            _, r = fresh.popleft()
            n = self.peer_fresh.get(r, 0) - 1
            if n > 0:
                self.peer_fresh[r] = n
            else:
                self.peer_fresh.pop(r, None)
        self.refresh_capacity()
        dropped = 0
        cut = now - self.ttl
        families = self.families
        while families:
            fid, fam = next(iter(families.items()))
            if fam.used >= cut:
                break
            del families[fid]
            self._uncount(fam.primary)
            dropped += 1
        spill_cut = now - self.ttl / 4
        warm_cut = now - WARM_HOLD
        for fam in families.values():
            if fam.warming is not None and fam.warming_at < warm_cut:
                fam.warming = None  # a bound: an answer lost on the way (or a stuck replica)
            if fam.secondary is not None and fam.secondary_used < spill_cut:
                fam.secondary = None
            if fam.former is not None and fam.former_used < spill_cut:
                fam.former = None
            if fam.third is not None and fam.third_used < spill_cut:
                fam.third = None
        for fam, _ in self.warming_spills.values():  # including families dropped since
            if fam.warming_at < warm_cut:
                fam.warming = None
        return dropped

    def take_warmed(self) -> list[tuple[int, str]]:
        """(family, secondary URL) of the spills this proxy waited on whose first answer
        came (or that were let go) since the last call: the other proxies stop waiting."""
        done = [(fid, r) for fid, (fam, r) in self.warming_spills.items()
                if fam.warming is not r]
        for fid, _ in done:
            del self.warming_spills[fid]
        return [(fid, r.url) for fid, r in done]

    def adopt(self, entries: Iterable[tuple[int, str, float]]) -> int:
        """Merge placements other proxies published (family, URL, when placed).

        The shared entry wins over this proxy's own (first writer wins in Redis): a
        family placed elsewhere moves here to that primary. An entry naming a replica
        this proxy does not know is skipped; returns how many were skipped.
        """
        skipped = 0
        cut = self.now - self.ttl
        for fid, url, at in entries:
            replica = self.by_url.get(url)
            if replica is None or at < cut or at > self.now + 60:
                skipped += replica is None or at > self.now + 60
                continue
            fam = self.families.get(fid)
            if fam is None:
                self._add(fid, replica, publish=False)
                if (not self.batching and abs(at - self.now) <= PEER_FRESH
                        and len(self._fresh) < MAX_OUTBOX):
                    self._fresh.append((at, replica))  # its cold prompt starts there now
                    self.peer_fresh[replica] = self.peer_fresh.get(replica, 0) + 1
            elif fam.primary is not replica:
                fam.moved_from = fam.primary
                self._uncount(fam.primary)
                fam.unlink(replica)
                fam.primary = replica
                self.placed[replica] = self.placed.get(replica, 0) + 1
        return skipped

    def adopt_spills(self, entries: Iterable[tuple[int, str, float]]) -> int:
        """Merge the secondaries the proxies share (family, URL, when written).

        The shared one replaces this proxy's own. Skipped: an entry naming a replica not in
        the set (counted), older than a secondary lives (`ttl / 4`), for a family this
        proxy has not placed, or naming the family's primary. Returns how many counted.
        """
        skipped = 0
        now = self.now
        cut = now - self.ttl / 4
        for fid, url, at in entries:
            replica = self.by_url.get(url)
            if replica is None or at > now + 60:
                skipped += 1
                continue
            fam = self.families.get(fid)
            if (at < cut or fam is None or fam.primary is replica
                    or replica.left_at is not None):
                continue
            if fam.secondary is not replica:
                if fam.former is not replica and at >= now - WARM_HOLD:
                    # Just chosen by another proxy: its first request there computes the
                    # prompt; the overflow here waits for it too (until `adopt_warm`).
                    fam.warming = replica
                    fam.warming_at = at
                fam.replace_secondary(replica)
            if fam.secondary_used < at:
                fam.secondary_used = at
        return skipped

    def adopt_warm(self, entries: Iterable[tuple[int, str, float]]) -> int:
        """The first answer came from these new secondaries (family, URL, when), sent by
        the proxies that spilled there: the overflow may follow. An entry naming a replica
        not in the set is skipped; returns how many were."""
        skipped = 0
        for fid, url, _ in entries:
            replica = self.by_url.get(url)
            if replica is None:
                skipped += 1
                continue
            fam = self.families.get(fid)
            if fam is not None and fam.warming is replica:
                fam.warming = None
        return skipped

    # -- on the request path --------------------------------------------------------------

    def place(self, order: Sequence[ReplicaView], exclude: set[ReplicaView] | None,
              bound: int, skip: ReplicaView | None = None, *,
              fleet: bool = False, seen: bool = False) -> ReplicaView | None:
        """The best replica for a family (see the module docstring); None: nobody.
        `seen`: order by the fleet's load as the in-flight hash showed it (`peer_seen`, a
        second old) plus this proxy's live counts: for a placed family's overflow, a
        decision the other proxies adopt, where this proxy's own ~1/N share of the counts
        is noise."""
        placed = self.placed
        capacity = self.capacity
        default = self.default_capacity
        best: ReplicaView | None = None
        b_over = b_full = True
        b_load = 0
        b_ratio = 0.0
        b_traffic = 0.0
        b_cold = 0
        traffic = self.traffic
        peer_traffic = self.peer_traffic
        peer_fresh = self.peer_fresh
        batching = self.batching
        idle = False
        if not batching:  # the fleet's in flight and waiting: fewer than replicas, it idles
            busy = 0
            for r in order:
                busy += r.inflight + r.engine_queue + r.peer_seen
            idle = busy < len(order)
        for r in order:
            if r is skip or r.left_at is not None or (exclude is not None and r in exclude):
                continue
            # `fleet`: over the bound on the fleet's load (the other proxies' counts, as
            # they last announced them, included). Ordered on this proxy's own live counts:
            # every proxy preferring the replica the others' counts showed idle would herd
            # there.
            load = r.inflight + r.engine_queue
            over = (load + r.peer_inflight if fleet else load) >= bound
            load += r.prefilling  # a cold prefill in flight counts twice in the order
            if seen:
                load += r.peer_seen
            else:
                load += r.peer_prefilling  # the other proxies' cold prompts there, once
            n = placed.get(r, 0)
            cap = capacity.get(r, default)
            full = n >= cap
            recent = traffic.get(r, 0.0) + peer_traffic.get(r, 0.0) + peer_fresh.get(r, 0)
            # Batching engines: a new family's cold prompt goes to a replica computing no
            # cold prompt of this proxy's, whatever the load (a prefill holds the batch's
            # step for every request there awaiting its first token); else to the one
            # computing the fewest of their bytes, in KiB (the prefill's length).
            cold = 0
            if batching and not seen and r.prefilling:
                cold = 1 + (r.prefill_bytes >> PREFILL_SHIFT)
            if best is not None:
                if over != b_over and not idle:
                    if over:
                        continue
                elif full != b_full:
                    if full:
                        continue
                elif cold != b_cold:
                    if cold > b_cold:
                        continue
                elif idle and recent != b_traffic:
                    if recent > b_traffic:
                        continue
                elif load != b_load:
                    if load > b_load:
                        continue
                elif n / cap != b_ratio:
                    if n / cap > b_ratio:
                        continue
                elif batching or recent >= b_traffic:
                    continue
            best, b_over, b_full, b_load, b_ratio = r, over, full, load, n / cap
            b_traffic = recent
            b_cold = cold
        return best

    def add(self, fid: int, replica: ReplicaView) -> None:
        """This proxy placed `fid` on `replica` (queued for publishing)."""
        self._add(fid, replica, publish=True)

    def _add(self, fid: int, replica: ReplicaView, *, publish: bool) -> None:
        families = self.families
        families[fid] = Family(replica, self.now)
        self.placed[replica] = self.placed.get(replica, 0) + 1
        if len(families) > self.max_families:
            _, old = families.popitem(last=False)
            self._uncount(old.primary)
        if publish and len(self.outbox) < MAX_OUTBOX:
            self.outbox.append((fid, replica.url))

    def spill(self, fid: int, fam: Family, replica: ReplicaView) -> None:
        """`fam`'s primary (and secondary, if any) is saturated: `replica` takes the
        overflow, queued for publishing."""
        moved = fam.secondary is not None
        warm = fam.former is replica
        fam.replace_secondary(replica)
        fam.secondary_used = self.now
        if not warm:
            fam.warming = replica
            fam.warming_at = self.now
        if len(self.spill_outbox) < MAX_OUTBOX:
            self.spill_outbox.append((fid, replica.url, moved))
            if len(self.warming_spills) < MAX_OUTBOX:
                self.warming_spills[fid] = (fam, replica)

    def spilled_turn(self, block: int, replica: ReplicaView) -> None:
        """A request whose key holds `block` (last but one) spilled to `replica` (queued)."""
        if len(self.turn_outbox) < MAX_OUTBOX:
            self.turn_outbox.append((block, replica.url))

    def move(self, fam: Family, replica: ReplicaView) -> None:
        """`fam`'s primary is gone or excluded: `replica` is its primary now."""
        self._uncount(fam.primary)
        fam.primary = replica
        fam.unlink(replica)
        self.placed[replica] = self.placed.get(replica, 0) + 1

    def forget(self, fid: int, unused_since: float) -> None:
        """Drop family `fid` if it was not used since `unused_since` (its shared entry
        went to make room: proxy/sources/placement.py)."""
        fam = self.families.get(fid)
        if fam is not None and fam.used < unused_since:
            del self.families[fid]
            self._uncount(fam.primary)

    def _uncount(self, replica: ReplicaView) -> None:
        n = self.placed.get(replica)
        if n:
            self.placed[replica] = n - 1
