"""The `prefix` policy: prompt-prefix affinity that every proxy agrees on.

A model server keeps the KV cache of recent prompts; a request whose prompt
starts like an earlier one on the same replica skips most of its prefill. This
policy sends requests that share a prompt prefix to the same replica
(docs/routing.md has the user-facing story). With `placement: capacity` (or `auto`
once the Redis source shares it) a new prompt family is placed by load and free
cache capacity instead of by the rendezvous order (proxy/placement.py, and
proxy/sources/placement.py for the sharing); the rest is as follows:

- **Key** (`request_key`), from the raw body bytes, no JSON parse: the bytes
  from `"messages"` (chat) or `"prompt"` (completions) on, cut into blocks of
  `block_bytes` and hashed as a chain (block i's hash covers blocks 0..i, like
  the model server's own block hashes). Only complete blocks count: a prompt
  shorter than one block has nothing worth caching and goes to the fallback.
  A session header (`X-Session-Id` by default) or, if enabled, the JSON `user`
  field is the key instead. CRC-32 chains the blocks: it is stable across
  processes (unlike `hash()`, which is salted per process) and costs ~0.1 µs
  a block.
- **Choice**: rendezvous (highest-random-weight) hashing of the first block's
  hash over the snapshot's replicas. Replica weights come from blake2b of the
  replica URL and a slot of the key space (`SLOTS` slots): every proxy and
  worker holding the same set computes the same order, and a change of the
  set moves only the slots whose winner came or went. A slot's order is
  computed once per snapshot, on first use; a request does one list index.
- **Bounded load**: walking that order, a replica already holding
  ceil((1 + epsilon) x (in flight + 1) / replicas) requests, or `spill_margin`
  more than that mean (whichever is fewer), is skipped (consistent hashing with
  bounded loads; with --fleet-load, for a known prefix,
  in flight through every proxy: the shared placement sets the other proxies' counts,
  `peer_inflight`, as they announce them about every 100 ms; a new prefix is judged on
  this proxy's own live counts, see `_capacity`); hot prefixes spill to their second
  choice, and keep spilling to where they spilled before while it has room
  (so a hot prefix is cached on two replicas, not on all). A prefix this
  proxy never routed may not take a replica above the mean in flight (so
  unshared traffic spreads like `least_load`), and is then remembered at its
  first choice (as on every other proxy): the next request of its family may
  load it like a known prefix. No candidate left: the fallback policy
  (`least_load`).
- **Longest prefix**: a per-proxy LRU maps the chain hashes of blocks 2.. to
  the replica that first received them, so a conversation's next turn (or a
  long shared prompt) follows its longest known prefix. The first writer
  wins, so the LRU repeats the rendezvous choice unless that replica was
  full; proxies may disagree on it, the rendezvous order is the agreement.
  With shared placement it also learns (`learn`) the blocks other proxies
  announce for requests they sent to a family's spill replica.
- **Warm copies** (`warm_copies`, on by default): a family's new copy (a secondary, or
  a third copy) is not sent the request that made it, which would compute the prompt
  cold; that request goes where the prompt is (`_held`), and the request carries
  `prewarm`, the copy and a callback (`_warm_done`), for the exchange to hand to its
  Warmer (proxy/warmup.py): a one-token warm-up of the same body. The copy is `warming`
  until the warm-up answers, as for a cold first request.

Reasons are counted per replica (`routed`): affinity (first choice or LRU
hit), spill (skipped a full replica), fallback (no key or nobody within the
bound); exported on the admin port's /metrics. Each decision is also a prediction
(proxy/outcomes.py): a hit when a known prefix (LRU) or a placed family goes to its
replica, else a miss; the request gets that replica's counters for it (`outcome`),
and the exchange counts the engine's reported cached tokens into them.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from zlib import crc32

from proxy.interfaces import Policy, ReplicaView, Routable
from proxy.outcomes import PREDICTED_HIT, PREDICTED_MISS, new_outcomes
from proxy.placement import Family, PlacementTable
from proxy.wire.snapshot import PrefixOptions

SLOTS = 4096  # rendezvous is computed per slot of the key space (a power of two)
# s; a secondary that took its family's overflow this recently (on the placement table's
# coarse clock, 1 s) is warm enough to share the family's load (_warm_copy).
WARM_RECENT = 2.0
# A hot family gets a third copy (_warm_copy) only while the caches are at most this full
# (the placement table's families over the replicas' summed capacity): in fuller caches
# a third copy evicts another family's prompt.
THIRD_COPY_FULLNESS = 0.5
# In flight the primary and the secondary each hold above the mean, and the third copy
# below it, before a hot family gets one (the fleet's counts: _third_copy). 1, 2 and 4
# measured alike on the simulator's overload (bench/README.md).
THIRD_COPY_GAP = 2

# Indexes into a replica's `routed` counters.
AFFINITY, SPILL, FALLBACK = 0, 1, 2
REASONS = ("affinity", "spill", "fallback")

_MESSAGES = b'"messages"'
_PROMPT = b'"prompt"'
_USER = b'"user"'
_NO_KEY: tuple[int, ...] = ()


def prefix_chain(body: bytes, block: int, limit: int) -> tuple[int, ...]:
    """Chain hashes of the complete `block`-byte blocks from `"messages"`/`"prompt"` on.

    Only the first `limit` bytes of `body` are looked at. `()` when neither key
    occurs or no complete block follows it.
    """
    start = body.find(_MESSAGES, 0, limit)
    if start < 0:
        start = body.find(_PROMPT, 0, limit)
        if start < 0:
            return _NO_KEY
    end = min(len(body), limit)
    h = 0
    chain = []
    i = start + block
    while i <= end:
        # A bytes slice (a copy) costs fewer instructions than a memoryview slice.
        h = crc32(body[i - block:i], h)
        chain.append(h)
        i += block
    return tuple(chain)


def json_string_after(body: bytes, key: bytes, limit: int) -> bytes | None:
    """The raw bytes of the string value of top-level-looking `key` (e.g. b'"user"').

    Occurrences not followed by `:` are values (`"role": "user"`) and skipped.
    Escapes stay as they are (the bytes are only hashed); an escaped quote does
    not end the string. None when there is no such string value in `body[:limit]`.
    """
    n = min(len(body), limit)
    pos = body.find(key, 0, n)
    while pos >= 0:
        i = pos + len(key)
        while i < n and body[i] in b" \t\r\n":
            i += 1
        if i < n and body[i] == 0x3A:  # ':'
            i += 1
            while i < n and body[i] in b" \t\r\n":
                i += 1
            if i >= n or body[i] != 0x22:  # not a string: no key
                return None
            j = i + 1
            while True:
                j = body.find(b'"', j, n)
                if j < 0:
                    return None
                k = j - 1
                while body[k] == 0x5C:  # count the backslashes before the quote
                    k -= 1
                if (j - 1 - k) % 2 == 0:
                    return body[i + 1:j]
                j += 1
        pos = body.find(key, pos + 1, n)
    return None


def request_key(headers: list[tuple[bytes, bytes]], body: bytes,
                options: PrefixOptions, header_name: bytes) -> tuple[int, ...]:
    """The routing key: a session (header, `user` field) or the prompt's block chain.

    A session key is one hash; a prompt key is the chain (first block first).
    """
    if header_name:
        size = len(header_name)
        for name, value in headers:
            if len(name) == size and name.lower() == header_name and value:
                return (crc32(value, 0x53455353),)
    if options.user_field:
        user = json_string_after(body, _USER, options.prefix_bytes)
        if user:
            return (crc32(user, 0x55534552),)
    return prefix_chain(body, options.block_bytes, options.prefix_bytes)


def replica_seed(url: str) -> hashlib.blake2b:
    """The per-replica hasher rendezvous weights derive from (stable across processes)."""
    return hashlib.blake2b(url.encode() + b"\0", digest_size=8)


def rendezvous_order(seeds: Sequence[hashlib.blake2b], slot: int) -> list[int]:
    """Indexes of the replicas by descending weight for `slot` (ties: by index)."""
    slot_bytes = slot.to_bytes(4, "big")
    weights = []
    for i, seed in enumerate(seeds):
        h = seed.copy()
        h.update(slot_bytes)
        weights.append((-int.from_bytes(h.digest(), "big"), i))
    weights.sort()
    return [i for _, i in weights]


class PrefixPolicy:
    """Prefix affinity with bounded load; see the module docstring."""

    name = "prefix"

    def __init__(self, options: PrefixOptions | None, fallback: Policy) -> None:
        opts = options if options is not None else PrefixOptions()
        self.options = opts
        # Body bytes the server holds back before choosing (the key's window).
        self.body_prefix = opts.prefix_bytes
        self._header = opts.session_header.lower().encode("latin-1")
        self._load_factor = 1.0 + opts.epsilon
        # A known prefix's replica is skipped this far above the mean, whatever epsilon:
        # the fleet's margin, split among the proxies sharing it (set_proxies), and grown
        # with the fullness of the caches (_rescale).
        self._fleet_margin = opts.spill_margin
        self._proxies = 1
        self._fullness = 0.0
        self._margin = opts.spill_margin or 1 << 30
        # How far above this proxy's own mean a secondary may be and still take the overflow
        # of a primary over its bound (_rescale): 0 for a proxy alone, more for one of several.
        self._slack = 0
        self._lru_size = opts.lru_size
        self._fallback = fallback
        self._replicas: tuple[ReplicaView, ...] = ()
        self._seeds: list[hashlib.blake2b] = []
        self._orders: list[tuple[ReplicaView, ...] | None] = []
        self._lru: OrderedDict[int, ReplicaView] = OrderedDict()
        # Known prefix (its deepest known block) -> where it last spilled.
        self._spilled: OrderedDict[int, ReplicaView] = OrderedDict()
        # replica URL -> [affinity, spill, fallback]; kept across snapshots.
        self.routed: dict[str, list[int]] = {}
        self._counts: dict[ReplicaView, list[int]] = {}
        # replica URL -> (predicted hit, predicted miss) outcome counters (proxy/outcomes.py):
        # a routed request gets the list of its replica and prediction, the exchange
        # counts the engine's report into it.
        self.outcomes: dict[str, tuple[list[int], list[int]]] = {}
        self._outcomes: dict[ReplicaView, tuple[list[int], list[int]]] = {}
        self._predicted = PREDICTED_MISS  # of the decision being made (set by choose)
        self._warms: Family | None = None  # likewise: a family whose new secondary it is
        # warm_copies (proxy/warmup.py): a family's new copy is warmed up instead of taking
        # a client's request cold. `_can_warm`: the decision being made may ask for it (the
        # request's body is here in full); `_prewarm`: what it asked (set on the request).
        self._warm_copies = opts.warm_copies
        self._can_warm = False
        self._prewarm: tuple[ReplicaView, Callable[[bool], None]] | None = None
        # An engine hit: at least one block's worth of cached tokens (~4 bytes a token).
        self._hit_tokens = opts.block_bytes // 4
        # Placement by load and free cache capacity (proxy/placement.py); None: rendezvous.
        self.placement: PlacementTable | None = None
        if opts.placement == "capacity":
            self.enable_placement()

    def enable_placement(self) -> None:
        """Place families by load and capacity from now on (`placement: capacity`, or
        `auto` once the Redis source shares the placement: proxy/sources/placement.py)."""
        if self.placement is not None:
            return
        opts = self.options
        table = PlacementTable(
            default_capacity=opts.replica_families, window_tokens=opts.prefix_bytes // 4,
            ttl=opts.placement_ttl, max_families=max(64, opts.lru_size // 4))
        table.update(self._replicas)
        self.placement = table

    @property
    def spill_margin(self) -> int:
        """The margin this proxy applies now (`spill_margin`, grown with the caches'
        fullness, split among the proxies sharing the fleet: _rescale); 0 when it is off."""
        return self._margin if self._fleet_margin else 0

    def set_proxies(self, n: int) -> None:
        """`n` proxies share the fleet (the Redis source, once a second; 1 with
        --fleet-load, whose loads are the fleet's already): see _rescale."""
        if self._fleet_margin:
            self._proxies = max(1, n)
            self._rescale(self._fullness)

    def _rescale(self, fullness: float) -> None:
        """The margin for caches this full (`fullness`: the placement table's families over
        the replicas' summed capacity, 0 to 1) and `n` proxies sharing the fleet.

        - A proxy that judges the fleet's load (alone, or with --fleet-load: n is 1)
          applies ceil(spill_margin x (1 + fullness)): a spill into free cache costs one
          cold prefill; into a full one it also evicts another family, whose next request
          is cold too. On the simulator 8 hot groups (a sixth of the caches) wanted 8, 48
          groups filling them 16 (bench/README.md, "A margin that grows as the caches
          fill").
        - Each of n > 1 proxies judges its own ~1/n of the requests: its count of a
          replica's excess over the mean is ~1/n of the fleet's, plus noise of about its
          square root. Each applies spill_margin / sqrt(n), rounded up, at least 1, however
          full the caches: at 1/n the noise alone spilled families and 4 proxies' hit rate
          fell 2-4 points (bench/README.md, "spill_margin 8"); growing it with the caches
          measured worse on 8 hot groups (0.25 -> 0.30 s), and 1/n while the caches had
          room worse on 4 llama.cpp servers (mean TTFT 0.23-0.26 -> 0.40-0.43 s, two runs
          each; but two runs of the same code there gave 0.23 and 0.37 s: bench/README.md,
          "A margin that grows as the caches fill", "A warm secondary").
        - A family whose secondary is warm (it answered the family, and took its overflow
          in the last WARM_RECENT seconds) shares its load with it, any n: once the
          primary is above the mean, a request goes to whichever of the two holds fewer
          (_warm_copy). With the margin alone each of 4 proxies, counting ~1/4 of a hot
          primary's load, piled ~4 x 4 requests over the mean on it where one proxy stops
          at 8-10; a tighter margin on a warm secondary (spill_margin x (1 + fullness) /
          (2 n)) halved that; comparing the two replicas' counts balances each proxy's
          share, so the fleet's (bench/README.md, "A warm secondary", "A hot family's two
          replicas share its load").
        - With n > 1 proxies a secondary is "above the mean" (the overflow of a primary
          over its bound leaves it for another replica) only beyond `_slack` over this
          proxy's own mean: spill_margin x (1 + fullness) / (2 n) while the caches are
          empty, moving to the margin above as they fill. At ~1/n of the fleet's counts the
          noise alone moved a hot family's overflow 5-6 times in 5 s, each move a cold
          prefill (bench/README.md, "The overflow goes back to its former secondary").
        """
        self._fullness = fullness
        if self._fleet_margin:
            n = self._proxies
            if n == 1:
                self._margin = math.ceil(self._fleet_margin * (1.0 + fullness))
                self._slack = 0
            else:
                margin = max(1, math.ceil(self._fleet_margin / math.sqrt(n)))
                share = self._fleet_margin * (1.0 + fullness) / (2 * n)
                self._margin = margin
                self._slack = max(1, min(margin, math.ceil(
                    margin + (share - margin) * (1.0 - fullness))))

    def update(self, replicas: Sequence[ReplicaView]) -> None:
        self._replicas = tuple(replicas)
        self._fallback.update(replicas)
        self._seeds = [replica_seed(r.url) for r in self._replicas]
        self._orders = [None] * SLOTS  # filled on first use, per snapshot
        counts = {}
        outcomes = {}
        for r in self._replicas:
            counts[r] = self.routed.setdefault(r.url, [0, 0, 0])
            outcomes[r] = self.outcomes.setdefault(r.url, new_outcomes(self._hit_tokens))
        self._counts = counts
        self._outcomes = outcomes
        if self.placement is not None:
            self.placement.update(self._replicas)

    def order_for(self, slot: int) -> tuple[ReplicaView, ...]:
        order = self._orders[slot]
        if order is None:
            reps = self._replicas
            order = tuple(reps[i] for i in rendezvous_order(self._seeds, slot))
            self._orders[slot] = order
        return order

    def key_of(self, request: Routable) -> tuple[int, ...]:
        key = request.route_key
        if key is None:
            body = request.body
            raw = body[0] if len(body) == 1 else b"".join(body)
            key = request_key(request.req_headers, raw, self.options, self._header)
            request.route_key = key
        return key

    def choose(self, exclude: set[ReplicaView] | None,
               request: Routable | None = None) -> ReplicaView | None:
        if not self._replicas:
            return None
        if request is None:
            return self._fall_back(exclude)
        key = self.key_of(request)
        self._predicted = PREDICTED_MISS  # a hit only where a known prefix is routed
        self._can_warm = self._warm_copies and request.body_done
        if not key:
            chosen = self._fall_back(exclude)
        elif len(key) > 1 and self._lru_size:
            chosen = self._choose_known(key, exclude)
        else:
            # A prefix this proxy never routed may not load a replica above the mean (so
            # unshared traffic balances like least_load); a known one, or a session, may
            # take (1 + epsilon) x the mean: its cache is worth waiting for.
            factor = self._load_factor if len(key) == 1 else 1.0
            if self.placement is not None:
                chosen = self._choose_placed(key, exclude, factor, -1)
            else:
                chosen = self._choose_agreed(key, exclude, factor, -1, None)
        if chosen is not None:
            table = self.placement
            if table is not None and not table.batching:  # recent traffic (PlacementTable)
                traffic = table.traffic
                traffic[chosen] = traffic.get(chosen, 0.0) + 1.0
            pair = self._outcomes.get(chosen)  # None: a fallback outside the set
            request.outcome = pair[self._predicted] if pair is not None else None
            request.cold = self._predicted == PREDICTED_MISS and bool(key)
        request.warms = self._warms
        self._warms = None
        if self._prewarm is not None:
            request.prewarm = self._prewarm
            self._prewarm = None
        return chosen

    def _choose_known(self, key: tuple[int, ...],
                      exclude: set[ReplicaView] | None) -> ReplicaView | None:
        """Step 1: the replica of the longest prefix this proxy routed before (the LRU).

        Its replica full: where the prefix spilled before, else the rendezvous order
        (step 2). Unknown, gone or excluded: the rendezvous order.
        """
        lru = self._lru
        factor = 1.0  # unknown prefix: at most the mean
        capacity = -1
        for d in range(len(key) - 1, 0, -1):
            hit = lru.get(key[d])
            if hit is None:
                continue
            factor = self._load_factor
            if hit.left_at is not None or (exclude is not None and hit in exclude):
                break
            fam = None
            if self.placement is not None:
                fam = self.placement.families.get(key[0])
                if fam is not None:
                    if fam.moved_from is hit:
                        break  # another proxy placed the family first: follow it there
                    self.placement.families.move_to_end(key[0])
                    fam.used = self.placement.now  # in use: it does not expire
                    if hit is fam.secondary:  # a turn that spilled there: it is warm
                        fam.secondary_used = fam.used
            lru.move_to_end(key[d])  # refresh: most recent last
            load = hit.inflight + hit.peer_inflight + hit.engine_queue
            if load:
                capacity = self._capacity(factor)
                if load >= capacity or (fam is not None and hit is fam.primary
                                        and self._warm_copy(fam, load, exclude) is not None):
                    return self._spill(key, d, exclude, capacity)
            return self._routed_known(key, d, hit, AFFINITY)
        if self.placement is not None:
            return self._choose_placed(key, exclude, factor, capacity)
        return self._choose_agreed(key, exclude, factor, capacity, None)

    def _spill(self, key: tuple[int, ...], d: int, exclude: set[ReplicaView] | None,
               capacity: int) -> ReplicaView | None:
        """The replica of known block `key[d]` is over the bound: spill where this prefix
        spilled before (it is cached there too), so a hot prefix occupies two replicas'
        caches, not every replica's; else walk the rendezvous order."""
        if self.placement is not None:
            return self._choose_placed(key, exclude, self._load_factor, capacity)
        full = key[d]
        alt = self._spilled.get(full)
        if (alt is not None and alt.left_at is None
                and alt.inflight + alt.peer_inflight + alt.engine_queue < capacity
                and (exclude is None or alt not in exclude)):
            return self._routed_known(key, d, alt, SPILL)
        return self._choose_agreed(key, exclude, self._load_factor, capacity, full)

    def _routed_known(self, key: tuple[int, ...], d: int, chosen: ReplicaView,
                      reason: int) -> ReplicaView:
        """Routed on known block `key[d]`: its deeper blocks go where it went (a
        predicted hit: the replica got this prefix before)."""
        self._predicted = PREDICTED_HIT
        if len(key) - 1 > d:
            lru = self._lru
            for h in key[d + 1:]:
                lru[h] = chosen
            while len(lru) > self._lru_size:
                lru.popitem(last=False)
        self._counts[chosen][reason] += 1
        return chosen

    def _choose_agreed(self, key: tuple[int, ...], exclude: set[ReplicaView] | None,
                       factor: float, capacity: int, full: int | None) -> ReplicaView | None:
        """Step 2: the first replica in the key's rendezvous order within the bound
        (`capacity`, computed here if still -1), remembered in the LRU; none: the fallback.
        `full`: the known block whose replica was over the bound (remember the spill)."""
        agreed: ReplicaView | None = None  # the first choice not excluded
        chosen: ReplicaView | None = None
        reason = AFFINITY
        fleet = factor != 1.0
        for r in self.order_for(key[0] & (SLOTS - 1)):
            if exclude is not None and r in exclude:
                continue
            if agreed is None:
                agreed = r
            load = r.inflight + r.engine_queue
            if fleet:
                load += r.peer_inflight
            if load:
                if capacity < 0:
                    capacity = self._capacity(factor)
                if load >= capacity:
                    reason = SPILL
                    continue
            chosen = r
            break
        if chosen is None:
            return self._fall_back(exclude)
        if full is not None:
            spilled = self._spilled
            spilled[full] = chosen
            spilled.move_to_end(full)
            if len(spilled) > self._lru_size // 4 + 1:
                spilled.popitem(last=False)
        if len(key) > 1 and self._lru_size:
            # Remember where the blocks went (first writer wins). A prefix never seen
            # that spilled (its first choice above the mean) is remembered at its
            # first choice: its family's next request goes there, within the bound
            # of a known prefix, as on every other proxy, instead of being walked
            # to another cold replica each time.
            pin = chosen
            if agreed is not None and factor == 1.0 and reason == SPILL:
                pin = agreed
            self._remember(key, pin)
        self._counts[chosen][reason] += 1
        return chosen

    def _choose_placed(self, key: tuple[int, ...], exclude: set[ReplicaView] | None,
                       factor: float, capacity: int) -> ReplicaView | None:
        """Step 2 with placement (proxy/placement.py): the family's primary within the
        bound, else its secondary while that is at or below the mean; a family not placed
        yet (or its overflow past both) gets the replica with the lowest load and free
        cache capacity."""
        table = self.placement
        assert table is not None
        fid = key[0]
        fam = table.families.get(fid)
        chosen: ReplicaView | None = None
        reason = AFFINITY
        shared = False  # the primary's load is shared with its warm secondary
        held = False  # waiting for a new secondary's first answer
        if fam is not None:
            table.families.move_to_end(fid)
            fam.used = table.now
            if factor != self._load_factor:
                factor = self._load_factor  # a placed family: its cache is worth the wait
                capacity = -1
            third = fam.third  # a warm third copy takes the overflow before a move
            if third is not None and fam.third_used < table.now - WARM_RECENT:
                third = None
            for r in (fam.primary, fam.secondary, third, fam.former):
                if r is None or r.left_at is not None or (exclude is not None and r in exclude):
                    continue
                if r is fam.warming and reason == SPILL:
                    # The first request this proxy spilled there is still computing the
                    # prompt: on a per-slot cache (llama.cpp) a second would compute it
                    # again (a cold prefill each, both stalling that replica). The overflow
                    # waits until the first answers: at the former secondary, which still
                    # holds the prompt, while that is within the bound, else at the primary
                    # (over the bound, not gone).
                    chosen = self._held(fam, exclude, capacity, table.now)
                    held = True
                    break
                load = r.inflight + r.peer_inflight + r.engine_queue
                if load:
                    if capacity < 0:
                        capacity = self._capacity(factor)
                    if load >= capacity:
                        reason = SPILL
                        continue
                    if r is fam.primary:
                        copy = self._warm_copy(fam, load, exclude)
                        if copy is not None:
                            # Above the mean, and a warm copy holds fewer: there, even
                            # above the mean itself (the copies share the family's load).
                            reason = SPILL
                            shared = True
                            if copy is fam.secondary:
                                continue
                            chosen = copy  # the third copy
                            break
                    if (reason == SPILL and r is not fam.primary
                            and not (shared and r is fam.secondary)
                            and load >= self._known_mean() + self._slack):
                        # The primary is over the bound and the secondary (or the former
                        # one, after it) above the mean:
                        # the overflow goes to the least loaded replica (place) instead,
                        # which becomes the secondary. A secondary allowed
                        # to fill up to the bound queued the overflow of a family too hot
                        # for one replica while others idled (bench/README.md, "A margin
                        # above the mean").
                        reason = SPILL
                        continue
                chosen = r
                break
            if chosen is not None:
                self._predicted = PREDICTED_HIT  # the family's own replica
                if held:
                    if chosen is fam.primary:
                        reason = AFFINITY
                    else:  # the former: kept warm while the hold lasts
                        fam.former_used = table.now
                        reason = SPILL
                elif chosen is fam.third:
                    fam.third_used = table.now
                    reason = SPILL
                    if fam.third_cold:  # its first request: it computes the prompt
                        fam.third_cold = False
                        self._predicted = PREDICTED_MISS
                elif chosen is fam.secondary:
                    fam.secondary_used = table.now
                    reason = SPILL
                elif chosen is not fam.primary:  # the former secondary, still warm: back
                    table.spill(fid, fam, chosen)
                    reason = SPILL
        if chosen is None:
            if capacity < 0:
                capacity = self._capacity(factor)
            chosen = table.place(self.order_for(fid & (SLOTS - 1)), exclude, capacity,
                                 fam.primary if fam is not None else None,
                                 fleet=factor != 1.0, seen=fam is not None)
            if chosen is None:
                return self._fall_back(exclude)
            if fam is None:
                table.add(fid, chosen)
            elif (fam.primary.left_at is not None
                  or (exclude is not None and fam.primary in exclude)):
                table.move(fam, chosen)  # its replica is gone or failed: the family moves
            else:
                table.spill(fid, fam, chosen)  # saturated: the overflow moves here
                reason = SPILL
                if fam.warming is chosen and self._can_warm:
                    # warm_copies: the new secondary gets a warm-up of the prompt; this
                    # request waits where the prompt is, as the overflow does meanwhile.
                    self._prewarm = (chosen, self._warm_done(fam, chosen))
                    chosen = self._held(fam, exclude, capacity, table.now)
                    self._predicted = PREDICTED_HIT
                    if chosen is fam.primary:
                        reason = AFFINITY
                else:
                    self._warms = fam
        if len(key) > 1 and self._lru_size:
            # The last block but one: the last may hold the body's tail after the
            # messages, which the conversation's next turn does not repeat.
            turn = key[-2] if len(key) > 2 else key[-1]
            new = reason == SPILL and turn not in self._lru
            self._remember(key, chosen)
            if new:  # a spill the other proxies would not follow: tell them
                # Only a block this proxy had not routed before: one it had is shared by
                # other requests (a system prompt's last block, under a short question),
                # and every proxy that learnt it would send the whole family there.
                table.spilled_turn(turn, chosen)
        self._counts[chosen][reason] += 1
        return chosen

    def _held(self, fam: Family, exclude: set[ReplicaView] | None, capacity: int,
              now: float) -> ReplicaView:
        """Where a family's overflow waits while its new secondary computes the prompt:
        the former secondary (the one the overflow just moved off) while it is within the
        bound (`capacity`) and took the family's overflow within WARM_RECENT (it holds
        the prompt), else the primary."""
        former = fam.former
        if capacity < 0:
            capacity = self._capacity(self._load_factor)
        if (former is not None and former.left_at is None
                and (exclude is None or former not in exclude)
                and former.inflight + former.peer_inflight + former.engine_queue < capacity
                and fam.former_used >= now - WARM_RECENT):
            return former
        return fam.primary

    def _warm_copy(self, fam: Family, load: int,
                   exclude: set[ReplicaView] | None) -> ReplicaView | None:
        """Where the family's primary, holding `load` (above the mean), sends this request
        to share its load: the warm copy holding the fewest, if it holds fewer than the
        primary; else None (the primary takes it). The copies: the secondary, warm when it
        answered the family, is not gone, and took the family's overflow within
        WARM_RECENT, so it still holds the prompt on any engine (a per-slot cache like
        llama.cpp's reuses the slot soon after); and, while the caches have room
        (THIRD_COPY_FULLNESS), a third copy, warm likewise.

        The replicas' own counts are compared, not one against a margin over the mean:
        each of N proxies sees ~1/N of the fleet's requests, so a margin on its counts is
        N times too loose or noise, where balancing its own share between the copies
        balances the fleet's (bench/README.md, "A hot family's two replicas share its
        load").

        A family without a warm third copy gets one (_third_copy) when the primary and
        the secondary both hold THIRD_COPY_GAP more than the mean and another replica that
        many fewer; this request goes there and computes the prompt. On the simulator's
        overload (8 groups, Zipf 1.4, 48 req/s) the hottest family needed about two of four
        replicas, and its secondary also held small families: both sat above the mean
        while a third replica idled below it, and smg spread the same family over three
        replicas (bench/README.md, "A third copy for a hot family"). A proxy alone looks
        when its own counts show both copies that far above the mean; one of several
        looks at most once a clock tick, on the fleet's counts."""
        secondary = fam.secondary
        table = self.placement
        if (secondary is None or fam.warming is secondary or secondary.left_at is not None
                or table is None or fam.secondary_used < table.now - WARM_RECENT
                or (exclude is not None and secondary in exclude)):
            return None
        mean = self._known_mean()  # the counts `load` and `held` are on
        if load < mean:
            return None
        held = secondary.inflight + secondary.peer_inflight + secondary.engine_queue
        best: ReplicaView | None = None
        fewest = load
        if held < load:
            best, fewest = secondary, held
        if table.fullness <= THIRD_COPY_FULLNESS:
            third = fam.third
            if third is not None and third is fam.warming:
                return best  # its warm-up runs (warm_copies): the two copies share meanwhile
            if (third is not None and third.left_at is None
                    and fam.third_used >= table.now - WARM_RECENT
                    and (exclude is None or third not in exclude)):
                if third.inflight + third.peer_inflight + third.engine_queue < fewest:
                    best = third
                return best
            if self._proxies == 1:
                if min(load, held) < mean + THIRD_COPY_GAP:
                    return best
            elif fam.third_checked == table.now:
                return best  # one look at the fleet's counts a tick (they change as often)
            fam.third_checked = table.now
            idle = self._third_copy(fam, exclude)
            if idle is not None:
                fam.third = idle
                fam.third_used = table.now
                if self._can_warm:
                    # warm_copies: a warm-up computes the prompt there; until it answers
                    # the third copy is `warming` (the primary and the secondary share the
                    # load meanwhile) and this request goes to the copy holding fewer.
                    fam.warming = idle
                    fam.warming_at = table.now
                    fam.third_cold = False
                    self._prewarm = (idle, self._warm_done(fam, idle))
                    return best
                fam.third_cold = True
                return idle
        return best

    def _warm_done(self, fam: Family, replica: ReplicaView) -> Callable[[bool], None]:
        """The callback of `fam`'s warm-up on `replica` (proxy/warmup.py): the copy is no
        longer warming; answered, it is warm from now (its last use is now); not answered
        (failed, skipped), the copy is as without warm copies: the next request sent there
        computes the prompt (a third copy is marked cold again, not dropped, so a
        warm-up that always fails is not remade at every request)."""
        def done(ok: bool) -> None:
            if fam.warming is replica:
                fam.warming = None
            table = self.placement
            now = table.now if table is not None else 0.0
            if fam.third is replica:
                if ok:
                    fam.third_used = now
                else:
                    fam.third_cold = True  # as without warm copies: its next request
            elif ok and fam.secondary is replica:
                fam.secondary_used = now
        return done

    def _third_copy(self, fam: Family, exclude: set[ReplicaView] | None) -> ReplicaView | None:
        """The idlest replica that is neither the family's primary nor its secondary, if it
        holds THIRD_COPY_GAP fewer than the mean in flight and both of those hold that many
        more; else None. A replica's load counts the other proxies' in flight as the
        in-flight hash showed it (`peer_seen`, a second old: a proxy's own counts are ~1/N
        of the fleet's), or as they announced it with --fleet-load, whichever is more."""
        best: ReplicaView | None = None
        fewest = copies = 1 << 30  # the idlest other replica's load; the copies' lower
        seen = 0
        total = 0
        for r in self._replicas:
            held = r.inflight + max(r.peer_inflight, r.peer_seen) + r.engine_queue
            total += held
            if r is fam.primary or r is fam.secondary:
                copies = min(copies, held)
                seen += 1
            elif (held < fewest and r.left_at is None
                    and (exclude is None or r not in exclude)):
                best, fewest = r, held
        mean = total // len(self._replicas) + 1
        if (best is None or seen < 2 or fewest + THIRD_COPY_GAP >= mean
                or copies < mean + THIRD_COPY_GAP):
            return None
        return best

    def learn(self, blocks: Iterable[tuple[int, str, float]]) -> int:
        """The longest-prefix memory learns blocks other proxies routed off their family's
        replica (block, URL, when; proxy/sources/placement.py), first writer wins; an
        entry naming a replica not in the set, or older than a secondary lives, is
        skipped; returns how many named a replica not in the set."""
        table = self.placement
        if table is None or not self._lru_size:
            return 0
        skipped = 0
        lru = self._lru
        cut = table.now - table.ttl / 4
        for block, url, at in blocks:
            replica = table.by_url.get(url)
            if replica is None or at > table.now + 60:
                skipped += 1
            elif at >= cut and block not in lru:
                lru[block] = replica
        while len(lru) > self._lru_size:
            lru.popitem(last=False)
        return skipped

    def _remember(self, key: tuple[int, ...], replica: ReplicaView) -> None:
        """The LRU learns that the key's blocks 2.. are at `replica` (first writer wins)."""
        lru = self._lru
        for h in key[1:]:
            if h not in lru:
                lru[h] = replica
        while len(lru) > self._lru_size:
            lru.popitem(last=False)

    def _capacity(self, factor: float, margin: int = -1) -> int:
        """A replica holding this many requests or more is skipped (bounded load).

        factor 1.0 (a prefix never seen): at most the mean in flight, rounded down, so
        unshared traffic spreads about as evenly as least_load; else ceil((1 + epsilon)
        x the mean counting this request), as in consistent hashing with bounded loads,
        and at most `spill_margin` requests above that mean: with few replicas (1 +
        epsilon) x the mean is more than everything in flight, and a family too hot
        for one replica would queue there while the others idle (measured:
        bench/README.md, "A margin above the mean").
        A replica's load is its in-flight requests plus, with --engine-load, the requests
        waiting in its engine; for a known prefix also the other proxies' in flight as they
        last announced it (`peer_inflight`: 0 unless --fleet-load). Without those each of N proxies
        judges its own 1/N share: about 2 requests each where one proxy would see 8, and
        the rounded-up bound spills a family's second request to a cold replica. A new
        prefix stays on this proxy's own live counts: with the others' (then up to a second
        old) in its bound and order, every proxy would send unshared traffic to the
        replica that looked idle a second ago (measured: bench/README.md).
        """
        total = 0
        n = len(self._replicas)
        if factor == 1.0:
            for r in self._replicas:
                total += r.inflight + r.engine_queue
            return total // n + 1
        for r in self._replicas:
            total += r.inflight + r.peer_inflight + r.engine_queue
        mean = (total + 1) / n
        table = self.placement
        if table is not None and table.fullness != self._fullness:
            self._rescale(table.fullness)  # about once a second: refresh() sets it
        if margin < 0:
            margin = self._margin
        return min(math.ceil(factor * mean), math.ceil(mean) + margin)

    def _known_mean(self) -> int:
        """The mean in flight per replica (rounded down) plus one, as a known prefix's
        bound counts it: with --fleet-load the other proxies' in flight too
        (`peer_inflight`), else this proxy's own (`peer_inflight` is 0).

        The replicas a placed family's copies are judged on count the same (`load`, `held`
        in _choose_placed and _warm_copy): a primary above this mean shares its load with
        a warm copy (and may get a third one), and a secondary above it (plus `_slack`)
        loses the overflow to a cold replica. With --fleet-load the margin is the fleet's
        and `_slack` 0 (set_proxies(1)): on this proxy's own counts for the mean (~1/N of
        the fleet's), every hot primary looked above it and, on 4 proxies, a secondary
        left on noise: on the simulator's 8 hot groups 4 proxies made 8 warm-ups where 1
        made 3, and the fleet's counts here brought their p99 TTFT from 0.33 s to 0.09-0.13
        s (bench/README.md, "A family's copies judged on the fleet's counts")."""
        total = 0
        for r in self._replicas:
            total += r.inflight + r.peer_inflight + r.engine_queue
        return total // len(self._replicas) + 1

    def _fall_back(self, exclude: set[ReplicaView] | None) -> ReplicaView | None:
        chosen = self._fallback.choose(exclude)
        if chosen is not None:
            counts = self._counts.get(chosen)
            if counts is not None:
                counts[FALLBACK] += 1
        return chosen
