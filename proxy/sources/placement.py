"""Shared placement of the `prefix` policy's prompt families through Redis.

Every proxy (and every `--workers` process) places families by load and free
cache capacity (proxy/placement.py); this task makes them agree, off the
request path:

- **publish**: every `batch` seconds (20 ms) the families this proxy placed
  since (the table's `outbox`) are written with HSETNX to the hash
  `{prefix}:svc:{name}:placement` (field: the family as hex; value:
  `"<unix time> <replica url>"`): the first writer wins. The same pipeline
  HGETs each field back: a family another proxy placed first is adopted at
  once. The winners are PUBLISHed on `{prefix}:svc:{name}:placed` (the same
  lines), so every other proxy adopts them within one round trip.
- **secondaries** (a family's spill replica when its primary is over the load
  bound) go through the same hash and channel under the field `s<family hex>`:
  a first spill is HSETNX (first writer wins, the loser adopts the winner), an
  overflow that moved off a saturated secondary is HSET (the move is shared);
  both are read back in the same pipeline. A secondary lives `ttl / 4` (like the
  table's own), is re-written while this proxy still spills there, and is only
  adopted for a family placed here, naming a replica of the set other than the
  family's primary. (A proxy of a release before this parses `s...` fields as
  malformed and deletes them: during a rolling upgrade secondaries are shared
  only among upgraded proxies.)
- **spilled turns**: a request routed to a secondary has a deep block of its
  key (the last but one, when this proxy had not routed it before: one it had is
  shared by other requests) announced on the channel only (line `t<block hex> <at>
  <url>`, not stored); every other proxy's longest-prefix memory learns it
  (first writer wins), so
  the conversation's next turn, whichever proxy it reaches, follows its history
  to the spill replica instead of its family's primary. A proxy that missed the
  message routes that turn by family, as before.
- **warming secondaries**: a proxy that adopts a secondary another proxy chose
  less than `WARM_HOLD` (5 s) ago holds the family's overflow at its primary, as
  the spilling proxy itself does, until that proxy's first request there has its
  first response byte (the replica has the prompt): the spilling proxy then
  announces it on the channel (line `w<family hex> <at> <url>`, not stored).
  A lost announcement holds the overflow `WARM_HOLD` at most. (A proxy of a
  release before this counts `w` lines as malformed, like `t` lines before them.)
- **fleet loads** (with `--fleet-load`, or `auto` on batching engines: `set_loads`):
  every `LOAD_INTERVAL` (100 ms) the task announces the in-flight counts of this proxy
  per replica that changed since its last announcement, and all of them every
  `LOAD_REFRESH` (1 s), on the channel only (line `l<proxy hex> <at> <count> <url>`, not
  stored; the proxy hex is the CRC-32 of the proxy id). Every other proxy sets each
  replica's `peer_inflight` to the sum of the counts it heard from the others, dropping
  a proxy's count not heard for `LOAD_FRESH` (2.5 s, by the receiver's clock: the proxy
  stopped). So the `prefix` policy's bound judges the fleet's load at most about 100 ms
  old, for at most 10 PUBLISHes a second per proxy. A proxy not heard here (a release
  before this, which counts `l` lines as malformed; or this channel lost) is counted
  from the in-flight hash it writes once a second (proxy/sources/redis.py, `set_base`).
  Measured (bench/README.md, "The fleet's counts on the placement channel"): 4 proxies
  with it on 8 hot groups, 0.12-0.15 s mean TTFT, against 0.19-0.30 s on their own
  counts (1 proxy: 0.09 s).
- **cold prompts** (with the fleet loads): at every batch (20 ms) the task announces
  how many of this proxy's requests per replica are computing a cold prompt (sent as a
  predicted miss, no response byte yet: `Replica.prefilling`) where that changed, and
  all of them with the full counts every second (line `p<proxy hex> <at> <count>
  <url>`, not stored); every other proxy sums them into `peer_prefilling` and forgets
  them like the `l` counts. A cold prompt lasts one engine step of tens to hundreds of
  ms, so these go at the batch, not every 100 ms, and only when a count changed (a
  cold prompt is a new family, a warm-up or a miss: a few a second). The `prefix`
  policy counts them in a new family's order (proxy/placement.py): each of 4 proxies
  saw only its own, and placed new families onto replicas the others were filling.
  (A proxy of a release before this counts `p` lines as malformed.)
- **follow**: the task subscribes to that channel; and every `scan_interval`
  (1 s) it HSCANs at most `max_entries` fields (the cursor goes on at the
  next tick), adopting what it missed (a proxy that just started, a lost
  message). An entry older than the TTL, or malformed, is deleted (HDEL) by
  whoever sees it (one naming a replica not in the set only expires: a proxy
  may lag a set change);
  a family this proxy still uses is re-written (HSET) when its entry is older
  than half the TTL, so a hot family's entry lives on. The key itself expires
  (EXPIRE ttl on every write) once no proxy writes.
- **bounded and defensive**: the hash is capped at `max_entries` (from the
  replicas' cache capacity: 16 x the sum of their capacities, at least 256);
  a writer skips HSETNX while the last HLEN it saw is at the cap, and the scan
  makes room before it: over 7/8 of the cap, the oldest entries go, down to 3/4,
  sparing the families this proxy used in the last `ttl / 8` (`_make_room`: unique
  prompts, each a family, would otherwise fill the hash and stop sharing). Entries are
  parsed line by line: a field that is not hex of at most 8 digits, a value
  without a finite time (not more than a minute ahead) and a URL of the current
  ready set, a message over 1 MiB: skipped and counted (`stats.placements_skipped`,
  `sluice_placements_skipped`), never raised.

With `placement: auto` (the default) this task turns the policy's placement on at
its first tick: before it (and with no Redis source at all) the policy places by
rendezvous, as every proxy agrees on that without sharing. Redis down: the loop backs
off and retries; the table keeps its last view plus
this proxy's own decisions (never worse than the stateless policy).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any
from zlib import crc32

import redis.asyncio as aioredis

from proxy.placement import PlacementTable
from proxy.readyset import ReadySet
from proxy.stats import Stats

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20
MAX_FIELD = 8  # hex digits: families are 32-bit
MAX_VALUE = 2100  # a time and a URL of at most 2048 bytes
SPILL = b"s"  # field prefix of a family's secondary
TURN = b"t"  # line prefix of a spilled turn's block (channel only; not hex, like "s")
WARM = b"w"  # line prefix of a new secondary's first answer (channel only)
LOAD = b"l"  # line prefix of a proxy's in-flight count on a replica (channel only)
COLD = b"p"  # line prefix of a proxy's cold prompts computing on a replica (channel only)
LOAD_INTERVAL = 0.1  # s; the changed counts are announced this often
LOAD_REFRESH = 1.0  # s; and all of them this often, changed or not
LOAD_FRESH = 2.5  # s; a proxy's count not heard this long is dropped
MAX_LOAD = 1 << 20  # a replica's peer_inflight is clamped here
MAX_LOAD_PEERS = 1024  # proxies counted per replica (the rest are skipped)


def encode_entry(at: float, url: str) -> bytes:
    return f"{at:.3f} {url}".encode()


def spill_field(fid: int) -> str:
    return f"s{fid:x}"


def parse_entry(field: bytes | str,
                value: bytes | str) -> tuple[int, float, str, bytes] | None:
    """(family or block, at, url, kind) of one entry, or None when it is malformed; kind:
    b"" a primary, SPILL a secondary, TURN a spilled turn's block, WARM a secondary's
    first answer, LOAD a proxy's count (family: the proxy; url: "<count> <url>"), COLD
    its cold prompts likewise."""
    if isinstance(field, str):
        field = field.encode()
    if isinstance(value, str):
        value = value.encode()
    kind = field[:1]
    if kind in (SPILL, TURN, WARM, LOAD, COLD):
        field = field[1:]
    else:
        kind = b""
    if not 0 < len(field) <= MAX_FIELD or len(value) > MAX_VALUE:
        return None
    try:
        if not field.isalnum():  # int() takes signs, "_" and spaces
            return None
        fid = int(field, 16)
        at_raw, _, url_raw = value.partition(b" ")
        at = float(at_raw)
        url = url_raw.decode("ascii")
    except (ValueError, UnicodeDecodeError):
        return None
    if fid < 0 or not math.isfinite(at) or at < 0 or not url:
        return None
    return fid, at, url, kind


Entries = list[tuple[int, str, float]]  # (family or block, url, at)
Loads = list[tuple[int, str, int]]  # (proxy, replica url, in flight or cold prompts)


def _heard_sum(heard: dict[str, dict[int, tuple[int, float]]], url: str) -> int:
    """The counts the other proxies announced for `url` (of LOAD or COLD lines), summed."""
    per = heard.get(url)
    return sum(n for n, _ in per.values()) if per else 0


def parse_load(rest: str) -> tuple[str, int] | None:
    """(url, count) of a LOAD line's "<count> <url>", or None when it is malformed."""
    count_raw, _, url = rest.partition(" ")
    if not url or not count_raw.isdigit() or len(count_raw) > 7:
        return None
    return url, min(int(count_raw), MAX_LOAD)


class Lines:
    """A parsed `placed` message, by kind (each entry: family or block, url, at)."""

    __slots__ = ("colds", "entries", "loads", "skipped", "spills", "turns", "warm")

    def __init__(self) -> None:
        self.entries: Entries = []  # primaries
        self.spills: Entries = []  # secondaries
        self.turns: Entries = []  # spilled turns' blocks
        self.warm: Entries = []  # secondaries' first answers
        self.loads: Loads = []  # proxies' in-flight counts
        self.colds: Loads = []  # proxies' cold prompts computing
        self.skipped = 0


def parse_lines(payload: bytes) -> Lines:
    """A `placed` message: lines of "<field> <at> <url>", malformed ones counted."""
    out = Lines()
    if len(payload) > MAX_MESSAGE:
        out.skipped = 1
        return out
    by_kind = {b"": out.entries, SPILL: out.spills, TURN: out.turns, WARM: out.warm}
    for line in payload.split(b"\n"):
        if not line:
            continue
        field, _, value = line.partition(b" ")
        parsed = parse_entry(field, value)
        if parsed is None:
            out.skipped += 1
            continue
        if parsed[3] == LOAD or parsed[3] == COLD:
            load = parse_load(parsed[2])
            if load is None:
                out.skipped += 1
            else:
                (out.loads if parsed[3] == LOAD else out.colds).append(
                    (parsed[0], load[0], load[1]))
            continue
        by_kind[parsed[3]].append((parsed[0], parsed[2], parsed[1]))
    return out


class PlacementSync:
    """Publishes and follows the shared placement; see the module docstring."""

    def __init__(self, client: aioredis.Redis, ready_set: ReadySet, stats: Stats, *,
                 key: str, channel: str, batch: float = 0.02, scan_interval: float = 1.0,
                 proxy_id: str = "", loads: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self._ready_set = ready_set
        self._stats = stats
        self._key = key
        self._channel = channel
        self._batch = batch
        self._scan_interval = scan_interval
        self._clock = clock
        self._cursor = 0
        self._hlen = 0
        self._next_scan = 0.0
        self._failing = False
        self._warned_skip = False
        self.published = 0  # entries this proxy won (tests, status)
        self.adopted_messages = 0
        # Fleet loads (--fleet-load): this proxy's id on the channel, the counts it last
        # announced (url -> n), and what it heard (url -> {proxy: (n, when heard)}), each
        # by kind of count (LOAD: in flight, COLD: cold prompts).
        self._loads = loads
        self._proxy = crc32(proxy_id.encode())
        hex_id = f"{self._proxy:x}".encode()
        self._prefix = {LOAD: LOAD + hex_id, COLD: COLD + hex_id}
        self._sent: dict[bytes, dict[str, int]] = {LOAD: {}, COLD: {}}
        self._next_load = 0.0
        self._next_full = 0.0
        self._heard: dict[bytes, dict[str, dict[int, tuple[int, float]]]] = {LOAD: {}, COLD: {}}
        self.heard_from: dict[int, float] = {}  # proxy -> when its last count came
        # The counts of the proxies not heard on the channel, from the in-flight hash
        # (a second old; proxy/sources/redis.py, `set_base`): url -> n.
        self._base: dict[str, int] = {}

    def table(self) -> PlacementTable | None:
        policy = self._ready_set.policy
        options = getattr(policy, "options", None)
        auto = getattr(options, "placement", None) == "auto"
        if auto and getattr(policy, "placement", 1) is None:
            policy.enable_placement()  # type: ignore[attr-defined]  # shared from now on
        table = getattr(policy, "placement", None)
        return table if isinstance(table, PlacementTable) else None

    def max_entries(self, table: PlacementTable) -> int:
        return max(256, 16 * sum(table.capacity.values()))

    async def run(self, closing: Callable[[], bool]) -> None:
        """Until `closing()`: the listener and the batch loop, reconnecting with backoff."""
        while not closing():
            listener = asyncio.create_task(self._listen(), name="sluice-placement-listen")
            try:
                while not closing():
                    await asyncio.sleep(self._batch)
                    if listener.done():
                        listener.result()  # re-raise its failure: reconnect
                    await self.tick()
                    self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop's one broad except: back off and retry
                if not self._failing:
                    log.warning("shared placement: %s: %s; routing on the last view",
                                type(exc).__name__, exc)
                self._failing = True
            finally:
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
            if not closing():
                await asyncio.sleep(1.0)

    async def _listen(self) -> None:
        pubsub: Any = self._client.pubsub()
        try:
            await pubsub.subscribe(self._channel)
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is None or msg.get("type") != "message":
                    continue
                data = msg.get("data")
                if not isinstance(data, bytes):
                    continue
                lines = parse_lines(data)
                self.adopted_messages += 1
                skipped = lines.skipped
                if lines.loads:
                    skipped += self.hear_loads(lines.loads, self._clock())
                if lines.colds:
                    skipped += self.hear_loads(lines.colds, self._clock(), COLD)
                self._adopt(lines.entries, skipped, lines.spills, lines.turns, lines.warm)
        finally:
            self._forget_sent()  # announce everything again once back
            self.forget_loads()
            await pubsub.aclose()

    def _adopt(self, entries: Iterable[tuple[int, str, float]], skipped: int,
               spills: Iterable[tuple[int, str, float]] = (),
               turns: Entries | None = None, warm: Entries | None = None) -> None:
        table = self.table()
        if table is not None:
            skipped += table.adopt(entries)
            skipped += table.adopt_spills(spills)  # after: a spill needs its primary
            if warm:
                skipped += table.adopt_warm(warm)
            if turns:
                learn = getattr(self._ready_set.policy, "learn", None)
                if learn is not None:
                    skipped += learn(turns)
        if skipped:
            self._stats.placements_skipped += skipped
            if not self._warned_skip:
                log.warning("shared placement: %d malformed or unknown entries skipped",
                            skipped)
                self._warned_skip = True

    async def tick(self) -> None:
        """One batch: publish the outbox, this proxy's changed cold-prompt counts and
        (every LOAD_INTERVAL) its in-flight counts; every scan_interval, refresh and scan."""
        now = self._clock()
        if self._loads:
            await self._announce_loads(now)
        table = self.table()
        if table is None:
            return
        if table.outbox or table.spill_outbox:
            await self._publish(table, now)
        if table.turn_outbox:
            turns, table.turn_outbox = table.turn_outbox, []
            await self._announce(TURN, turns, now)
        if table.warming_spills:
            warmed = table.take_warmed()
            if warmed:
                await self._announce(WARM, warmed, now)
        if now >= self._next_scan:
            self._next_scan = now + self._scan_interval
            table.refresh(now)
            await self._scan(table, now)

    async def _announce_loads(self, now: float) -> None:
        """This proxy's cold-prompt counts that changed since the last announcement, and
        (every LOAD_INTERVAL) its in-flight counts that did; all of both every
        LOAD_REFRESH (due or not), when the counts heard from proxies gone quiet expire.
        One PUBLISH."""
        full = now >= self._next_full
        if full:
            self._next_full = now + LOAD_REFRESH
            self.expire_loads(now)
        at = f" {now:.3f} ".encode()
        lines = self._changed(COLD, at, full)
        # All of them at a full tick, due or not: a count that stands still (a replica's
        # long streams) is never a changed one, and the others drop a count unheard for
        # LOAD_FRESH. Sent only when due as well, a full tick that fell between two due
        # ones (ticks come every batch and a bit: 48 of them may make a second) left it
        # out, and a count of steady streams could go unsent that long.
        if full or now >= self._next_load:
            self._next_load = now + LOAD_INTERVAL
            lines += self._changed(LOAD, at, full)
        if lines:
            await self._client.publish(self._channel, b"\n".join(lines))

    def _changed(self, kind: bytes, at: bytes, full: bool) -> list[bytes]:
        """The lines of this proxy's counts of `kind` (LOAD: `inflight`, COLD: `prefilling`)
        that differ from those last sent (all non-zero ones if `full`), now sent."""
        known = self._ready_set.known
        sent = self._sent[kind]
        prefix = self._prefix[kind] + at
        lines: list[bytes] = []
        for url, replica in known.items():
            n = replica.inflight if kind == LOAD else replica.prefilling
            if n != sent.get(url, 0) or (full and n):
                lines.append(prefix + f"{n} {url}".encode())
                if n:
                    sent[url] = n
                else:
                    sent.pop(url, None)
        if full:
            for url in [u for u in sent if u not in known]:
                del sent[url]
        return lines

    def hear_loads(self, loads: Loads, now: float, kind: bytes = LOAD) -> int:
        """The other proxies' counts (proxy, url, n) of `kind` heard at `now`: each
        replica's `peer_inflight` is their sum (COLD: `peer_prefilling`). Returns
        the lines skipped (a replica not in the set, or a replica counted for
        MAX_LOAD_PEERS proxies already)."""
        if not self._loads:
            return 0
        known = self._ready_set.known
        heard = self._heard[kind]
        touched: set[str] = set()
        skipped = 0
        heard_from = self.heard_from
        for proxy, url, n in loads:
            if proxy == self._proxy:
                continue  # our own message, back from the channel
            if proxy not in heard_from and len(heard_from) >= MAX_LOAD_PEERS:
                skipped += 1
                continue
            heard_from[proxy] = now
            if url not in known:
                skipped += 1
                continue
            per = heard.get(url)
            if per is None:
                per = heard[url] = {}
            if n:
                if proxy not in per and len(per) >= MAX_LOAD_PEERS:
                    skipped += 1
                    continue
                per[proxy] = (n, now)
            else:
                per.pop(proxy, None)
            touched.add(url)
        for url in touched:
            self._set_peer(url)
        return skipped

    def expire_loads(self, now: float) -> None:
        """Drop the counts of proxies not heard for LOAD_FRESH, and of replicas gone."""
        cut = now - LOAD_FRESH
        known = self._ready_set.known
        for proxy in [p for p, at in self.heard_from.items() if at < cut]:
            del self.heard_from[proxy]
        for heard in self._heard.values():
            for url in list(heard):
                per = heard[url]
                stale = [p for p, (_, heard_at) in per.items() if heard_at < cut]
                for p in stale:
                    del per[p]
                if url not in known or not per:
                    del heard[url]
                if stale or not per:
                    self._set_peer(url)

    def forget_loads(self) -> None:
        """The channel is lost: no count heard is kept (the in-flight hash takes over)."""
        urls = [url for heard in self._heard.values() for url in heard]
        for heard in self._heard.values():
            heard.clear()
        self.heard_from.clear()
        for url in urls:
            self._set_peer(url)

    def set_loads(self, on: bool) -> None:
        """Announce and count the fleet's loads from now on, or stop (`--fleet-load auto`,
        proxy/sources/redis.py): off, every replica's `peer_inflight` goes back to 0."""
        if on == self._loads:
            return
        self._loads = on
        self._forget_sent()
        self._next_load = self._next_full = 0.0  # on: announce everything at the next tick
        if not on:
            self.forget_loads()
            self.set_base({})

    def _forget_sent(self) -> None:
        for sent in self._sent.values():
            sent.clear()

    def set_base(self, counts: dict[str, int]) -> None:
        """The other proxies' counts from the in-flight hash, without those heard on the
        channel (the hash's are a second old): each replica's `peer_inflight` is these
        plus the channel's."""
        self._base = counts
        for url in self._ready_set.known:
            self._set_peer(url)

    def _set_peer(self, url: str) -> None:
        replica = self._ready_set.known.get(url)
        if replica is not None:
            total = self._base.get(url, 0) + _heard_sum(self._heard[LOAD], url)
            replica.peer_inflight = min(total, MAX_LOAD)
            replica.peer_prefilling = min(_heard_sum(self._heard[COLD], url), MAX_LOAD)

    async def _announce(self, kind: bytes, items: list[tuple[int, str]], now: float) -> None:
        """Lines of `kind` (TURN, WARM) on the channel only, never stored."""
        await self._client.publish(self._channel, b"\n".join(
            kind + f"{key:x} ".encode() + encode_entry(now, url) for key, url in items))

    async def _publish(self, table: PlacementTable, now: float) -> None:
        box, table.outbox = table.outbox, []
        spill_box, table.spill_outbox = table.spill_outbox, []
        if self._hlen >= self.max_entries(table):
            return  # the hash is full: decide locally until entries expire
        # The primaries first: a secondary is adopted only for a family placed.
        writes = [(f"{fid:x}", fid, url, False) for fid, url in box]
        writes += [(spill_field(fid), fid, url, moved) for fid, url, moved in spill_box]
        async with self._client.pipeline(transaction=False) as pipe:
            for field, _, url, moved in writes:
                if moved:  # off a saturated secondary: the move is shared
                    pipe.hset(self._key, field, encode_entry(now, url))
                else:
                    pipe.hsetnx(self._key, field, encode_entry(now, url))
            for field, *_ in writes:
                pipe.hget(self._key, field)
            pipe.expire(self._key, int(table.ttl) + 1)
            results = await pipe.execute()
        n = len(writes)
        won: list[bytes] = []
        lost: list[tuple[int, str, float]] = []
        spills: list[tuple[int, str, float]] = []
        skipped = 0
        mine = encode_entry(now, "")
        for i, (field, fid, url, moved) in enumerate(writes):
            stored = results[n + i]
            if (results[i] and not moved) or (moved and stored == mine + url.encode()):
                won.append(f"{field} ".encode() + encode_entry(now, url))
                if field[:1] == "s":  # SPILL
                    spills.append((fid, url, now))  # ours again if a message replaced it
                continue
            parsed = parse_entry(field, stored) if stored is not None else None
            if parsed is None:
                skipped += stored is not None
                continue
            if parsed[3] == SPILL:
                spills.append((fid, parsed[2], parsed[1]))
            elif parsed[2] != url:
                lost.append((fid, parsed[2], parsed[1]))
        self._adopt(lost, skipped, spills)
        if won:
            self.published += len(won)
            await self._client.publish(self._channel, b"\n".join(won))

    def _make_room(self, table: PlacementTable,
                   live: list[tuple[float, bytes | str, int, str, bool]],
                   now: float) -> list[bytes | str]:
        """The hash near its cap (over 7/8 of it): the fields of its oldest entries, down
        to 3/4 of the cap, taken out of `live`. Spared: the families (and secondaries)
        this proxy used in the last `ttl / 8`. Families evicted that this proxy holds and
        has not used since then leave its table too (adopted one-offs: not counted
        against the replicas' capacity any longer).

        Without this, unique prompts (each its own family, each published) filled the
        hash within minutes and every proxy then skipped publishing until entries expired
        (the TTL): new families, and a session's next turn on another proxy, were decided
        per proxy, each computing the prompt cold."""
        cap = self.max_entries(table)
        if self._hlen <= cap * 7 // 8:
            return []
        recent = now - table.ttl / 8
        families = table.families
        spared: list[tuple[float, bytes | str, int, str, bool]] = []
        candidates: list[tuple[float, bytes | str, int, str, bool]] = []
        for item in live:
            fam = families.get(item[2])
            used = fam is not None and (fam.secondary_used if item[4] else fam.used) >= recent
            (spared if used else candidates).append(item)
        candidates.sort(key=lambda item: item[0])
        n = min(len(candidates), self._hlen - cap * 3 // 4)
        out = [field for _, field, _, _, _ in candidates[:n]]
        for _, _, fid, _, spill in candidates[:n]:
            if not spill:
                table.forget(fid, recent)
        live[:] = spared + candidates[n:]
        return out

    async def _scan(self, table: PlacementTable, now: float) -> None:
        cap = self.max_entries(table)
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hlen(self._key)
            pipe.hscan(self._key, self._cursor, count=cap)
            hlen, (cursor, found) = await pipe.execute()
        self._hlen = int(hlen)
        self._cursor = int(cursor)
        entries: list[tuple[int, str, float]] = []
        spills: list[tuple[int, str, float]] = []
        expired: list[bytes | str] = []
        refresh: dict[str, bytes] = {}
        skipped = 0
        live: list[tuple[float, bytes | str, int, str, bool]] = []
        for field, value in list(found.items())[:cap]:
            parsed = parse_entry(field, value)
            if parsed is None:
                skipped += 1
                expired.append(field)  # a hostile or broken entry goes
                continue
            fid, at, url, kind = parsed
            if kind in (TURN, WARM, LOAD, COLD):  # never stored: hostile
                skipped += 1
                expired.append(field)
                continue
            spill = kind == SPILL
            if at > now + 60:  # from the future: it would never expire
                skipped += 1
                expired.append(field)
                continue
            ttl = table.ttl / 4 if spill else table.ttl  # a secondary lives a quarter
            if at < now - ttl:
                expired.append(field)
                continue
            live.append((at, field, fid, url, spill))
        evicted = self._make_room(table, live, now)
        if evicted:
            expired += evicted
            self._hlen -= len(evicted)
        for at, _, fid, url, spill in live:
            (spills if spill else entries).append((fid, url, at))
            ttl = table.ttl / 4 if spill else table.ttl
            fam = table.families.get(fid)
            if at >= now - ttl / 2 or fam is None:
                continue
            if spill:  # this proxy still spills there: the entry lives on
                if (fam.secondary is not None and fam.secondary.url == url
                        and fam.secondary_used >= now - ttl / 2):
                    refresh[spill_field(fid)] = encode_entry(now, url)
            elif fam.primary.url == url and fam.used >= now - ttl / 2:
                refresh[f"{fid:x}"] = encode_entry(now, url)
        self._adopt(entries, skipped, spills)
        if expired or refresh:
            async with self._client.pipeline(transaction=False) as pipe:
                if expired:
                    pipe.hdel(self._key, *expired)
                if refresh:
                    pipe.hset(self._key, mapping=refresh)  # type: ignore[arg-type]
                pipe.expire(self._key, int(table.ttl) + 1)
                await pipe.execute()
