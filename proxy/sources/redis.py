"""The Redis source of the ready set (`sluice-proxy --redis URL --service NAME`), and
the request-rate flusher that feeds the autoscaler.

RedisSource keeps the proxy's ReadySet equal to the newest ReadySnapshot the
controller committed:

- subscribe to `{prefix}:svc:{name}:ready` first, then GET `{prefix}:svc:{name}:snapshot`,
  so no commit falls between the two; apply whichever is newer (ReadySet.apply
  ignores generations not above the current one, so stale and duplicate messages
  are no-ops);
- GET again on every (re)connect and every `resync_interval` seconds: pub/sub is
  at-most-once, and a message lost while reconnecting is recovered this way;
- a GET that answers an *older* generation than the one in force means Redis
  lost its data (restarted empty or from an older dump): that snapshot is
  applied, so generations restarting at 1 are followed instead of ignored;
- a payload that fails validation is rejected: the set in force stays, the
  payload is logged and counted once (`stats.snapshots_rejected`);
- Redis unreachable: keep the last snapshot, reconnect with capped, jittered
  backoff (`stats.source_connected` says which).

Every `flush_interval` seconds it also adds the requests counted since the last
flush (`stats.requests_total`) to `{prefix}:svc:{name}:rps`, field = the unix
second; a failed flush keeps the count for the next one. With the same tick it
writes this proxy's in-flight requests per replica into
`{prefix}:svc:{name}:inflight` (field = proxy id; the concurrency autoscaler
sums the fresh entries), and its heartbeat into `{prefix}:svc:{name}:proxies`
(field = proxy id: the generation it serves, when it applied it, the last 32
applies): `sluice status` shows from it how far each proxy lags. Both hashes
expire with the rps key when no proxy writes any more; readers prune entries
whose heartbeat is stale. The same round trip GETs `{prefix}:svc:{name}:engines`, the
engines' own telemetry the controller scrapes (proxy/wire/engines.py), parsed leniently
and set on each replica (`Replica.engine`; None when the key is gone: no controller,
or it stopped scraping); `/metrics` re-exports it. It also HGETALLs the in-flight hash
(entries older than `PEER_FRESH` seconds, malformed or beyond `MAX_PEERS` are skipped):
the number of other proxies with a fresh entry tells the `prefix` policy how many share
the fleet (`set_proxies`: each applies its share of `spill_margin`). With `--fleet-load`
it also sets on each replica the requests the *other* proxies had in flight there at
their last flush (`Replica.peer_inflight`), leaving out the proxies heard on the placement
channel, whose counts there are about 100 ms old (proxy/sources/placement.py adds them):
the `prefix` policy's bound for a known family counts them, so with N proxies it judges
the fleet's load, not its own 1/N share. `--fleet-load auto` turns that on
while the engine view names batching engines only (`fleet_wanted`), and off otherwise.
When a request is held because the set is empty, it publishes a "demand" nudge on
`{prefix}:control` at once (at most one per second), so a service scaled to zero starts
a replica without waiting for the autoscaler's tick. Nothing here runs on the request path.

Key names, payload structs and the subscribe/GET/re-GET sequence (feed.py) come from
the wire contract (proxy/wire/).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from zlib import crc32

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from proxy.compat import timeout
from proxy.config import ProxyConfig
from proxy.errors import ConfigError
from proxy.readyset import ReadySet
from proxy.redisurl import RedisURLError, client_from_url, redis_tls_options
from proxy.sources.placement import MAX_LOAD, PlacementSync
from proxy.stats import Stats
from proxy.stopping import bounded, stop_tasks
from proxy.tally import RoutedTally, cut_total, response_classes
from proxy.wire.engines import EngineStats, EngineView, batching_only, decode_engine_view
from proxy.wire.errors import SnapshotInvalid
from proxy.wire.feed import SnapshotFeed
from proxy.wire.keys import Keys
from proxy.wire.snapshot import decode_snapshot
from proxy.wire.telemetry import InflightEntry, Nudge, ProxyHeartbeat, encode_nudge

log = logging.getLogger("sluice.proxy.redis")


def fleet_wanted(engines: Iterable[EngineStats | None]) -> bool:
    """`--fleet-load auto`: whether a known family's load bound should count the other
    proxies' in flight: when the engines the view names are all batching engines
    (proxy/wire/engines.batching_only); not when any is another (llama.cpp) or none is
    named.

    Measured (bench/README.md, "`--fleet-load` again"): on the simulator, which batches
    like vLLM, 4 proxies came within 1.5 % of 1 with the fleet's counts and 14 % behind
    without; on llama.cpp servers with 2 slots, each slot its own cache, the fleet-sized
    bound spilled families to cold servers sooner and computed 6-10 % more prompt tokens,
    in five runs out of five (bench/README.md, "`--fleet-load auto` by default")."""
    return batching_only(engines)


_ENCODER = msgspec.json.Encoder()
_RECENT_APPLIES = 32
_INFLIGHT_DECODER = msgspec.json.Decoder(InflightEntry)
# Another proxy's in-flight entry counts while it is at most this old (seconds); a proxy
# that stopped leaves its field behind until the hash expires.
PEER_FRESH = 3.0
MAX_PEERS = 1024  # in-flight entries read per flush (the rest are skipped)


class RedisSource:
    """Feeds a ReadySet from Redis and flushes request counts back; see the module doc.

    Reads `redis_url`, `service`, `redis_prefix`, `sync_interval` (the re-GET
    period) and `sync_timeout` (per Redis command) from the config; the keyword
    arguments tune the rest. The constructor only assigns; `start()` connects and starts the three
    background tasks (sync, rps flush, demand nudges), `aclose()` cancels and awaits them and
    closes the client.
    """

    def __init__(
        self,
        config: ProxyConfig,
        stats: Stats,
        *,
        resync_interval: float | None = None,
        flush_interval: float = 1.0,
        backoff_initial: float = 0.1,
        # Short: a Redis failover takes a few seconds, and a proxy should follow the new
        # primary within about a second of its promotion, not after a long backoff.
        backoff_max: float = 1.0,
        connect_timeout: float = 2.0,
        start_timeout: float = 2.0,
        rps_ttl: int = 3600,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if config.redis_url is None or config.service is None:
            raise ConfigError("--redis needs a URL and --service NAME")
        self._url = config.redis_url
        self._tls = redis_tls_options(config.redis_url, config.redis_ca_file)
        self._service = config.service
        self._stats = stats
        keys = Keys(config.redis_prefix)
        self._keys = keys
        self._rps_key = keys.rps(config.service)
        self._inflight_key = keys.inflight(config.service)
        self._proxies_key = keys.proxies(config.service)
        self._engines_key = keys.engines(config.service)
        self._engines_warned = False
        self._peers_warned = False
        self._engine_load = config.engine_load
        self._fleet_mode = config.fleet_load
        # Whether the fleet's counts are on now: fixed for "on"/"off", else `fleet_wanted`
        # at each flush (off until the engine view names the engines).
        self._fleet_load = config.fleet_load == "on"
        stats.fleet_load = int(self._fleet_load)
        self._control = keys.control
        self._proxy_id = config.proxy_id or f"{socket.gethostname()}:{os.getpid()}"
        self._proxy_id_bytes = self._proxy_id.encode()
        self._routed = RoutedTally()  # the heartbeat's routing-reason totals
        self._nudge = encode_nudge(Nudge(service=config.service, reason="demand"))
        # The safety-net re-GET shares the sync interval of the other sources (5 s).
        self._resync_interval = config.sync_interval if resync_interval is None else resync_interval
        self._command_timeout = config.sync_timeout
        self._flush_interval = flush_interval
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._connect_timeout = connect_timeout
        self._start_timeout = start_timeout
        self._rps_ttl = rps_ttl
        self._clock = clock
        self._ready_set: ReadySet | None = None
        self._client: aioredis.Redis | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self._demand_task: asyncio.Task[None] | None = None
        self._placement_task: asyncio.Task[None] | None = None
        self.placement: PlacementSync | None = None  # the prefix policy's shared placement
        self._demand = asyncio.Event()
        self._synced = asyncio.Event()
        self._failures = 0  # consecutive failed sessions; drives the backoff
        self._flushed = 0  # stats.requests_total at the last successful flush
        self._flush_failing = False
        self._applied_any = False
        self._rejected: deque[bytes] = deque(maxlen=16)  # digests of rejected payloads
        self._closing = False  # set by aclose(); every loop checks it (see proxy/stopping.py)
        # (generation, applied_at) of the last applies, sent with every heartbeat so a
        # reader sees when each recent commit reached this proxy, not only the last one.
        self._applies: deque[tuple[int, float]] = deque(maxlen=_RECENT_APPLIES)

    @property
    def connected(self) -> bool:
        """True while subscribed and in sync with Redis."""
        return self._stats.source_connected == 1

    async def start(self, ready_set: ReadySet) -> None:
        """Connect, load the current snapshot (waiting up to `start_timeout`), and keep
        following. Redis being down is not an error: the loop keeps trying."""
        if self._client is not None:
            raise RuntimeError("RedisSource already started")
        try:
            self._client = client_from_url(
                self._url,
                socket_connect_timeout=self._connect_timeout,
                socket_timeout=self._command_timeout,
                # Reconnection is ours (backoff, re-GET); redis-py must not retry quietly.
                retry=Retry(NoBackoff(), 0),
                **self._tls,
            )
        except RedisURLError as exc:
            raise ConfigError(f"--redis: {exc}") from exc
        self._ready_set = ready_set
        self._flushed = self._stats.requests_total
        self._sync_task = asyncio.create_task(self._sync_loop(), name="sluice-redis-sync")
        self._flush_task = asyncio.create_task(self._flush_loop(), name="sluice-rps-flush")
        self._demand_task = asyncio.create_task(self._demand_loop(), name="sluice-demand")
        self.placement = PlacementSync(
            self._client, ready_set, self._stats, key=self._keys.placement(self._service),
            channel=self._keys.placed(self._service), proxy_id=self._proxy_id,
            loads=self._fleet_load, clock=self._clock)
        self._placement_task = asyncio.create_task(
            self.placement.run(lambda: self._closing), name="sluice-placement")
        ready_set.set_hold_listener(self._demand.set)
        with contextlib.suppress(asyncio.TimeoutError):
            async with timeout(self._start_timeout):
                await self._synced.wait()

    async def aclose(self) -> None:
        """Stop the tasks, flush the last request counts, close the client: each step
        bounded (2 s in all), whatever state Redis is in."""
        self._closing = True
        if self._ready_set is not None:
            self._ready_set.set_hold_listener(None)
        await stop_tasks((self._sync_task, self._flush_task, self._demand_task,
                          self._placement_task), 1.0)  # fmt: skip
        self._sync_task = self._flush_task = self._demand_task = self._placement_task = None
        client, self._client = self._client, None
        if client is not None:
            await bounded(self._flush(client), min(0.5, self._command_timeout),
                          f"service {self._service}: the last rps flush")
            await bounded(client.aclose(), 0.5, "closing the Redis client")
        self._stats.source_connected = 0

    # -- following snapshots ------------------------------------------------------------------

    async def _sync_loop(self) -> None:
        while not self._closing:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop's one broad except: log, back off, retry
                if self._closing:
                    return  # a cancellation redis-py turned into an error
                was_connected = self._stats.source_connected == 1
                self._stats.source_connected = 0
                if was_connected or self._failures == 0:
                    ready_set = self._ready_set
                    generation = -1 if ready_set is None else ready_set.generation
                    log.warning(
                        "redis source for %s: %s; keeping generation %d, reconnecting",
                        self._service,
                        _describe(exc),
                        generation,
                    )
                else:
                    log.debug("redis source for %s: still failing: %s", self._service, exc)
            await asyncio.sleep(self._backoff())
            self._failures += 1

    def _backoff(self) -> float:
        ceiling = min(self._backoff_max, self._backoff_initial * 2.0 ** min(self._failures, 30))
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # equal jitter

    async def _session(self) -> None:
        """One connection's life: subscribe, GET, then follow; returns only by raising."""
        client = self._client
        assert client is not None
        feed = SnapshotFeed(client, self._keys, self._service,
                            resync_interval=self._resync_interval)
        try:
            await feed.subscribe(self._connect_timeout)
            stored = await feed.get()
            if stored is not None:
                self._offer(stored, via_publish=False)
            await self._read_engines(client)
            if self._failures:
                log.info(
                    "redis source for %s: reconnected at generation %d",
                    self._service,
                    self._generation(),
                )
            else:
                log.info("redis source for %s: connected at generation %d", self._service,
                         self._generation())
            self._failures = 0
            self._stats.source_connected = 1
            self._synced.set()
            while not self._closing:
                delivery = await feed.next()
                if delivery is not None:
                    self._offer(delivery.payload, via_publish=delivery.via_publish)
        finally:
            await feed.aclose()

    def _offer(self, raw: bytes, *, via_publish: bool) -> None:
        """Apply a payload if valid and newer; reject it (kept set, logged, counted) if not."""
        ready_set = self._ready_set
        assert ready_set is not None
        try:
            snapshot = decode_snapshot(raw)
            if snapshot.service != self._service:
                raise SnapshotInvalid(f"snapshot of service {snapshot.service!r}")
            reset = False
            if snapshot.generation <= ready_set.generation:
                if via_publish or snapshot.generation == ready_set.generation:
                    return  # stale or duplicate
                # The stored key went backwards. GETs and messages are handled in this one
                # task, so a commit we already applied was stored before this GET was sent:
                # only a Redis that lost its data (restarted empty, or from an older
                # snapshot) answers an older generation. Follow it, or we never would.
                log.warning(
                    "service %s: stored generation %d is below ours (%d): Redis lost state; "
                    "following it",
                    self._service,
                    snapshot.generation,
                    ready_set.generation,
                )
                reset = True
            applied = ready_set.apply(snapshot, reset=reset)
        except (SnapshotInvalid, ConfigError) as exc:
            self._reject(raw, exc)
            return
        if not applied:
            return
        # The first snapshot loaded is however old it is; only later ones measure how
        # long a commit took to reach this proxy.
        now = self._clock()
        if self._applied_any:
            self._stats.propagation.observe(max(0.0, now - snapshot.published_at))
        self._applied_any = True
        self._applies.append((snapshot.generation, now))
        # INFO: snapshots are rare (a commit of the controller), and each is a fact an
        # operator looks for when a request went somewhere unexpected.
        log.info(
            "service %s: applied generation %d (%d replicas, policy %s) via %s",
            self._service,
            snapshot.generation,
            len(snapshot.replicas),
            ready_set.policy.name,
            "publish" if via_publish else "get",
        )

    def _reject(self, raw: bytes, exc: Exception) -> None:
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        if digest in self._rejected:
            return  # the same payload again (the periodic re-GET): logged and counted once
        self._rejected.append(digest)
        self._stats.snapshots_rejected += 1
        log.warning(
            "service %s: rejected snapshot payload (%d bytes): %s; keeping generation %d",
            self._service,
            len(raw),
            str(exc)[:300],
            self._generation(),
        )

    def _generation(self) -> int:
        return -1 if self._ready_set is None else self._ready_set.generation

    # -- request counts ---------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        client = self._client
        assert client is not None
        interval = self._flush_interval
        while not self._closing:
            # Ticks on multiples of the interval (whole seconds by default), so each
            # flush covers about one second.
            await asyncio.sleep(interval - self._clock() % interval)
            try:
                await self._flush(client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop's one broad except; the count is kept
                if self._closing:
                    return
                if not self._flush_failing:
                    log.warning("service %s: rps flush failed: %s", self._service, _describe(exc))
                self._flush_failing = True
                # The engine view cannot be refreshed either: routing must not keep
                # counting queues that are gone (the replicas are unknown until Redis is back).
                self._apply_engines(None)
                self._apply_peers(None, 0.0)
            else:
                self._flush_failing = False

    async def _flush(self, client: aioredis.Redis) -> None:
        total = self._stats.requests_total
        delta = total - self._flushed
        now = self._clock()
        async with client.pipeline(transaction=False) as pipe:
            if delta > 0:
                # The second most of these requests fell in (the tick is just past its end).
                second = int(now - min(self._flush_interval, 1.0) / 2)
                pipe.hincrby(self._rps_key, str(second), delta)
                # Without a controller to trim it the hash would grow forever.
                pipe.expire(self._rps_key, self._rps_ttl)
            pipe.hset(self._inflight_key, self._proxy_id, self._inflight_payload(now))
            pipe.expire(self._inflight_key, self._rps_ttl)
            pipe.hset(self._proxies_key, self._proxy_id, self._heartbeat_payload(now))
            pipe.expire(self._proxies_key, self._rps_ttl)
            pipe.hgetall(self._inflight_key)
            pipe.get(self._engines_key)
            results = await pipe.execute(raise_on_error=False)
        for result in results[:-2]:
            if isinstance(result, Exception):
                raise result  # a counter write failed: keep the count for the next flush
        self._flushed = total
        peers = results[-2]
        if isinstance(peers, Exception):  # an ACL without HGETALL on it (docs/redis.md)
            if not self._peers_warned:
                log.warning("service %s: cannot read the other proxies' in-flight "
                            "counts (the prefix policy judges load as if this proxy "
                            "were the only one): %s", self._service, _describe(peers))
                self._peers_warned = True
            peers = None
        self._apply_peers(peers, now)
        engines = results[-1]
        if isinstance(engines, Exception):  # e.g. an ACL user without GET on the view
            if not self._engines_warned:
                log.warning("service %s: cannot read the engine view: %s", self._service,
                            _describe(engines))  # fmt: skip
                self._engines_warned = True
            engines = None
        self._apply_engines(engines)

    async def _read_engines(self, client: aioredis.Redis) -> None:
        """The engine view read with the snapshot, before the first request (the flush
        loop reads it every second after): the prefix policy knows the replicas' slots
        and engine kinds for its first placements. A bench's first second placed new
        families by the rule for llama.cpp on vLLM-style replicas without it. A user
        not allowed to GET the view is left to the flush loop, which says so once."""
        try:
            raw = await client.get(self._engines_key)
        except ResponseError:
            return
        self._apply_engines(raw if isinstance(raw, bytes) else None)

    def _apply_engines(self, raw: bytes | None) -> None:
        """Set each known replica's engine record from the published view (by URL); the
        prefix policy's placement table reads capacities and engine kinds from them at
        once (PlacementTable.refresh_capacity)."""
        assert self._ready_set is not None
        records: dict[str, EngineStats] = {}
        if raw is not None:
            try:
                view, dropped = decode_engine_view(raw)
            except ValueError as exc:
                view, dropped = EngineView(), 1
                if not self._engines_warned:
                    log.warning("service %s: ignoring the engine view: %s", self._service, exc)
            if dropped and not self._engines_warned:
                log.warning("service %s: engine view: %d invalid fields or records dropped",
                            self._service, dropped)  # fmt: skip
            self._engines_warned = self._engines_warned or bool(dropped)
            records = {r.url: r for r in view.replicas.values()}
        engine_load = self._engine_load
        for url, replica in self._ready_set.known.items():
            record = replica.engine = records.get(url)
            waiting = record.waiting if record is not None and engine_load else None
            replica.engine_queue = int(waiting) if waiting else 0
        table = getattr(self._ready_set.policy, "placement", None)
        if table is not None:
            table.refresh_capacity()

    def _apply_peers(self, raw: object, now: float) -> None:
        """From the other proxies' fresh entries in `raw` (the HGETALL; None: unknown):
        tell the policy how many proxies share the fleet (`set_proxies`: the prefix
        policy's spill margin is the fleet's, split among them) and, with --fleet-load,
        set each known replica's `peer_inflight` to their in-flight counts (else 0)."""
        assert self._ready_set is not None
        sums: dict[str, int] = {}
        seen: dict[str, int] = {}
        traffic: dict[str, float] = {}
        bad = 0
        fresh = 0
        if self._fleet_mode == "auto":
            self._set_fleet_load(fleet_wanted(r.engine for r in self._ready_set.known.values()))
        if isinstance(raw, dict):
            own = self._proxy_id_bytes
            # Proxies heard on the placement channel: their counts there are fresher.
            heard = self.placement.heard_from if self.placement is not None else {}
            cut = now - PEER_FRESH
            for n, (proxy, value) in enumerate(raw.items()):
                if n >= MAX_PEERS:
                    bad += len(raw) - n
                    break
                if proxy == own:
                    continue
                try:
                    entry = _INFLIGHT_DECODER.decode(value)
                except (msgspec.ValidationError, msgspec.DecodeError, TypeError):
                    bad += 1
                    continue
                if not cut <= entry.at <= now + PEER_FRESH:
                    continue  # a proxy that stopped, or a clock far ahead
                fresh += 1
                counted = self._fleet_load and crc32(proxy) not in heard
                for url, count in entry.replicas.items():
                    seen[url] = seen.get(url, 0) + count
                    if counted:
                        sums[url] = sums.get(url, 0) + count
                for url, routed in entry.traffic.items():
                    traffic[url] = traffic.get(url, 0.0) + routed
        if bad and not self._peers_warned:
            log.warning("service %s: %d in-flight entries of other proxies skipped "
                        "(malformed, or more than %d)", self._service, bad, MAX_PEERS)
            self._peers_warned = True
        for url, replica in self._ready_set.known.items():
            replica.peer_seen = min(seen.get(url, 0), MAX_LOAD)
        table = getattr(self._ready_set.policy, "placement", None)
        if table is not None:
            table.set_peer_traffic(traffic)
        set_proxies = getattr(self._ready_set.policy, "set_proxies", None)
        if set_proxies is not None:  # --fleet-load: the loads are the fleet's already
            set_proxies(1 if self._fleet_load else 1 + fresh)
        # start() made the placement task: peer_inflight = these + the channel's (clamped).
        if self._fleet_load and self.placement is not None:  # else peer_inflight stays 0
            self.placement.set_base(sums)

    def _set_fleet_load(self, on: bool) -> None:
        """`--fleet-load auto`: the fleet's counts on or off from now on (logged once a
        change)."""
        if on == self._fleet_load:
            return
        self._fleet_load = on
        self._stats.fleet_load = int(on)
        if self.placement is not None:
            self.placement.set_loads(on)
        kinds = sorted({r.engine.engine for r in self._ready_set.known.values()
                        if r.engine is not None}) if self._ready_set is not None else []
        log.info("service %s: the prefix policy's load bound %s the other proxies' "
                 "in-flight requests (--fleet-load auto; engines: %s)", self._service,
                 "counts" if on else "no longer counts", ", ".join(kinds) or "none reported")

    def _inflight_payload(self, now: float) -> bytes:
        assert self._ready_set is not None
        per_replica = {r.url: r.inflight for r in self._ready_set.known.values() if r.inflight}
        table = getattr(self._ready_set.policy, "placement", None)
        # This proxy's recent traffic per replica (per-slot engines only: empty else), to
        # a tenth of a request: the other proxies' idle-fleet order adds it to theirs.
        traffic = {r.url: round(v, 1) for r, v in table.traffic.items()
                   if v >= 0.05} if table is not None else {}
        return _ENCODER.encode(InflightEntry(
            at=now, total=sum(per_replica.values()), replicas=per_replica, traffic=traffic))

    def _heartbeat_payload(self, now: float) -> bytes:
        """What `sluice status` reads to show convergence."""
        assert self._ready_set is not None
        ready_set = self._ready_set
        return _ENCODER.encode(ProxyHeartbeat(
            generation=ready_set.generation,
            applied_at=ready_set.applied_at,
            seen_at=now,
            connected=self._stats.source_connected == 1,
            recent=list(self._applies),
            responses=response_classes(self._stats.responses),
            cuts=cut_total(self._stats),
            routed=self._routed.read(ready_set.policy),
        ))

    # -- demand -------------------------------------------------------------------------------

    async def _demand_loop(self) -> None:
        """Publish a demand nudge when a request is held with no replica (max 1/s)."""
        while not self._closing:
            await self._demand.wait()
            self._demand.clear()
            client = self._client
            if client is not None:
                try:
                    await client.publish(self._control, self._nudge)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the loop's one broad except
                    log.warning("service %s: demand nudge failed: %s", self._service,
                                _describe(exc))
            await asyncio.sleep(1.0)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
