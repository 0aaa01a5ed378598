"""`Telemetry` (`store.telemetry`): what the store reads and writes beside the records
and the audit events: the proxies' request rates, in-flight counts and heartbeats, the
controller's engine views and its last autoscaling decision.

None of it changes the ready set, so none of it goes through the commit transaction.
What proxies write (rps, inflight, proxies) is untrusted: read with the bounded read of
untrusted.py (a hash over its bounds is deleted unread) and decoded by its decoders
(what does not decode is skipped, counted in `rejects`, logged once a minute), never
fatal: it only informs the autoscaler and `sluice status`. An engine view that does not
parse is None; a field or record that does not parse is dropped (proxy/wire/engines.py),
and logged once per service.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import msgspec
import redis.asyncio as aioredis

from controlplane.errors import redis_errors
from controlplane.records import AutoscalerStatus
from controlplane.store.codec import AUTOSCALER_DECODER, ENCODER
from controlplane.store.untrusted import (
    BOUNDED_READ,
    ENFORCE_BOUNDS,
    MAX_FIELDS,
    MAX_HASH_BYTES,
    MAX_PLACEMENT_FIELDS,
    Rejects,
    count,
    decode_heartbeats,
    decode_inflight,
    decode_rps,
    second,
)
from proxy.wire.engines import EngineView, decode_engine_view, encode_engine_view
from proxy.wire.keys import Keys
from proxy.wire.telemetry import InflightEntry, ProxyHeartbeat

log = logging.getLogger("sluice.store")
_warned: set[str] = set()


class Telemetry:
    """The telemetry keys of the services under `keys`, on `redis`: one object owning
    its scripts (the bounded read and the bounds enforcement, registered here, no I/O
    yet). `Store` makes one on its client, keys, clock and `rejects` (`store.telemetry`).

    Every method raises StoreUnavailable/StoreError (`redis_errors`).
    """

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, clock: Callable[[], float], rejects: Rejects
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._clock = clock
        self._rejects = rejects
        self._bounded_read = redis.register_script(BOUNDED_READ)
        self._enforce_bounds = redis.register_script(ENFORCE_BOUNDS)

    # -- request rates ---------------------------------------------------------------------

    async def read_rps(self, name: str) -> dict[int, int]:
        """Request counts per unix second, as flushed by the proxies (all proxies summed).

        A field that is not an integer second with an integer count (written by hand,
        or by something that is not a sluice proxy) is skipped and logged.
        """
        raw = await self._read_bounded(self._keys.rps(name), name, "rps")
        return decode_rps(name, raw, self._rejects)

    async def read_rps_seconds(self, name: str, seconds: Iterable[int]) -> dict[int, int]:
        """The request counts of these unix seconds only (absent or malformed ones are
        left out): one HMGET, whatever the size of the hash, for readers that want the
        last few seconds of an hour-long hash (the dashboard). A value that is not a
        count (untrusted.count) is left out."""
        wanted = list(seconds)
        if not wanted:
            return {}
        with redis_errors():
            raw = await self._redis.hmget(self._keys.rps(name), [str(s) for s in wanted])
        counts = {}
        for at, raw_count in zip(wanted, raw, strict=True):
            parsed = None if raw_count is None else count(raw_count)
            if parsed is not None:
                counts[at] = parsed
        return counts

    async def trim_rps(self, name: str, before: int, until: int | None = None) -> int:
        """Delete request counts of seconds earlier than `before` (or later than `until`),
        and fields that are not a unix second with a count (counted in `rejects`);
        returns how many were deleted. A hash over its bounds is deleted whole."""
        key = self._keys.rps(name)
        raw = await self._read_bounded(key, name, "rps")
        old = []
        malformed = 0
        for field, value in raw.items():
            at = second(field)
            if at is None or count(value) is None:
                malformed += 1
                old.append(field)
            elif at < before or (until is not None and at > until):
                old.append(field)
        if malformed:
            self._rejects.reject(name, "rps", "not a unix second -> count in 0..1e9: deleted",
                                 malformed)  # fmt: skip
        if not old:
            return 0
        with redis_errors():
            deleted: int = await self._redis.hdel(key, *old)
        return deleted

    # -- in-flight counts and heartbeats -----------------------------------------------------

    async def read_inflight(self, name: str) -> dict[str, InflightEntry]:
        """Every proxy's in-flight counts (proxy id -> entry); stale ones included, the
        caller judges freshness by `at`. A field that fails to decode is skipped and
        deleted."""
        key = self._keys.inflight(name)
        raw = await self._read_bounded(key, name, "inflight")
        entries, skipped = decode_inflight(name, raw, self._rejects)
        if skipped:
            with redis_errors():
                await self._redis.hdel(key, *skipped)
        return entries

    async def read_proxies(
        self, name: str, *, stale_after: float = 30.0
    ) -> dict[str, ProxyHeartbeat]:
        """Every live proxy's heartbeat (proxy id -> ProxyHeartbeat), sorted by id.

        Entries not refreshed for `stale_after` seconds (by the store's clock) are
        proxies that stopped: they are deleted here, so the hash holds about one entry
        per live proxy process (a live one whose entry raced the delete writes it again
        within a second). A field that fails to decode is skipped and deleted.
        """
        now = self._clock()
        key = self._keys.proxies(name)
        raw = await self._read_bounded(key, name, "proxies")
        decoded, stale = decode_heartbeats(name, raw, self._rejects)
        beats: dict[str, ProxyHeartbeat] = {}
        for proxy_id, beat in decoded.items():
            if now - beat.seen_at > stale_after:
                stale.append(proxy_id)
            else:
                beats[proxy_id] = beat
        if stale:
            with redis_errors():
                await self._redis.hdel(key, *stale)
        return dict(sorted(beats.items()))

    # -- the bounds of what proxies write ----------------------------------------------------

    async def enforce_bounds(self, name: str) -> int:
        """Delete whichever of the service's proxy-written hashes (rps, inflight,
        proxies; placement, which the proxies size and trim themselves, with a larger
        field bound) is over its bounds (untrusted.py), unread; returns how many. The
        deletes work under `noeviction` at maxmemory, so a Redis filled through a proxy's
        user gets its memory back (counted in `rejects`)."""
        k = self._keys
        keys = [k.rps(name), k.inflight(name), k.proxies(name)]
        with redis_errors():
            deleted = int(await self._enforce_bounds(keys=keys, args=[MAX_FIELDS, MAX_HASH_BYTES]))
            deleted += int(await self._enforce_bounds(
                keys=[k.placement(name)], args=[MAX_PLACEMENT_FIELDS, MAX_HASH_BYTES]))
        if deleted:
            self._rejects.reject(name, "hash", f"{deleted} hash(es) over their field bound "
                                 f"or {MAX_HASH_BYTES} bytes: deleted", deleted)  # fmt: skip
        return deleted

    async def _read_bounded(self, key: str, name: str, kind: str) -> dict[bytes | str, bytes | str]:
        """The fields of a hash proxies write; {} (and the hash deleted) when it is over
        its bounds (untrusted.BOUNDED_READ)."""
        with redis_errors():
            reply = await self._bounded_read(keys=[key], args=[MAX_FIELDS, MAX_HASH_BYTES])
        if not reply[1]:
            self._rejects.reject(name, kind, f"the hash had {reply[0]} fields or over "
                                 f"{MAX_HASH_BYTES} bytes: deleted")  # fmt: skip
            return {}
        items = reply[2:]
        return dict(zip(items[::2], items[1::2], strict=True))

    # -- the controller's engine views and autoscaling decisions -----------------------------

    async def write_engines(self, views: Mapping[str, EngineView], ttl: float) -> None:
        """Publish the engine views (service name -> view), each with a TTL of `ttl` s (a
        view nobody refreshes disappears), every view in one round trip."""
        if not views:
            return
        with redis_errors():
            async with self._redis.pipeline(transaction=False) as pipe:
                for name, view in views.items():
                    pipe.set(self._keys.engines(name), encode_engine_view(view),
                             px=max(1, int(ttl * 1000)))  # fmt: skip
                await pipe.execute()

    async def read_engines(self, name: str) -> EngineView | None:
        """The service's engine view as last published, or None (none, expired, or
        unreadable); invalid fields and records are dropped from it."""
        with redis_errors():
            raw = await self._redis.get(self._keys.engines(name))
        if raw is None:
            return None
        try:
            view, dropped = decode_engine_view(raw)
        except ValueError as exc:
            if name not in _warned:
                _warned.add(name)
                log.warning("service %s: ignoring the engine view: %s", name, exc)
            return None
        if dropped and name not in _warned:
            _warned.add(name)
            log.warning("service %s: engine view: %d invalid fields or records dropped", name,
                        dropped)  # fmt: skip
        return view

    async def write_autoscaler(self, name: str, status: AutoscalerStatus) -> None:
        """Record the controller's last autoscaling decision (for `sluice status`)."""
        with redis_errors():
            await self._redis.set(self._keys.autoscaler(name), ENCODER.encode(status))

    async def read_autoscaler(self, name: str) -> AutoscalerStatus | None:
        """The controller's last autoscaling decision, or None (none yet, or unreadable)."""
        with redis_errors():
            raw = await self._redis.get(self._keys.autoscaler(name))
        if raw is None:
            return None
        try:
            return AUTOSCALER_DECODER.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
