"""What the store reads and writes beside the records: the audit events, the proxies'
request rates, in-flight counts and heartbeats, and the autoscaler's last decision.

None of it changes the ready set, so none of it goes through the commit transaction.
What proxies write (rps, inflight, proxies) is untrusted: read with the bounded read of
untrusted.py (a hash over its bounds is deleted unread) and decoded by its decoders
(what does not decode is skipped, counted in `rejects`, logged once a minute), never
fatal: it only informs the autoscaler and `sluice status`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from controlplane.errors import redis_errors
from controlplane.records import AutoscalerStatus, Event
from controlplane.store.codec import AUTOSCALER_DECODER, ENCODER, text
from controlplane.store.untrusted import (
    MAX_FIELDS,
    MAX_HASH_BYTES,
    Rejects,
    count,
    decode_heartbeats,
    decode_inflight,
    decode_rps,
    second,
)
from proxy.wire.keys import Keys
from proxy.wire.telemetry import InflightEntry, ProxyHeartbeat

log = logging.getLogger("sluice.store")


async def append_event(
    redis: aioredis.Redis,
    keys: Keys,
    name: str,
    kind: str,
    fields: Mapping[str, str | int | float] | None,
    *,
    at: float,
    maxlen: int,
) -> str:
    """`Store.append_event`; `at` is the event's time."""
    entry: dict[Any, Any] = {"kind": kind, "at": at}
    for key, value in (fields or {}).items():
        if key in entry:
            raise ValueError(f"event field {key!r} is reserved")
        entry[key] = value
    with redis_errors():
        entry_id = await redis.xadd(keys.events(name), entry, maxlen=maxlen, approximate=True)
    return text(entry_id)


async def events(redis: aioredis.Redis, keys: Keys, name: str, count: int) -> list[Event]:
    """`Store.events`."""
    with redis_errors():
        entries = await redis.xrevrange(keys.events(name), count=count)
    out = []
    for entry_id, raw in reversed(entries or []):
        data = {text(key): text(value) for key, value in (raw or {}).items()}
        out.append(
            Event(
                id=text(entry_id or b""),
                kind=data.pop("kind", ""),
                at=float(data.pop("at", 0.0)),
                fields=data,
            )
        )
    return out


async def _read_bounded(
    script: AsyncScript, key: str, name: str, kind: str, rejects: Rejects
) -> dict[bytes | str, bytes | str]:
    """The fields of a hash proxies write; {} (and the hash deleted) when it is over
    its bounds (untrusted.BOUNDED_READ)."""
    with redis_errors():
        reply = await script(keys=[key], args=[MAX_FIELDS, MAX_HASH_BYTES])
    if not reply[1]:
        rejects.reject(name, kind, f"the hash had {reply[0]} fields or over "
                       f"{MAX_HASH_BYTES} bytes: deleted")  # fmt: skip
        return {}
    items = reply[2:]
    return dict(zip(items[::2], items[1::2], strict=True))


async def read_rps_seconds(
    redis: aioredis.Redis, keys: Keys, name: str, seconds: list[int]
) -> dict[int, int]:
    """`Store.read_rps_seconds`: one HMGET, whatever the size of the hash; a value
    that is not a count (untrusted.count) is left out."""
    if not seconds:
        return {}
    with redis_errors():
        raw = await redis.hmget(keys.rps(name), [str(s) for s in seconds])
    counts = {}
    for at, raw_count in zip(seconds, raw, strict=True):
        parsed = None if raw_count is None else count(raw_count)
        if parsed is not None:
            counts[at] = parsed
    return counts


async def read_rps(
    redis: aioredis.Redis, keys: Keys, name: str, script: AsyncScript, rejects: Rejects
) -> dict[int, int]:
    """`Store.read_rps`."""
    raw = await _read_bounded(script, keys.rps(name), name, "rps", rejects)
    return decode_rps(name, raw, rejects)


async def trim_rps(
    redis: aioredis.Redis,
    keys: Keys,
    name: str,
    before: int,
    until: int | None,
    script: AsyncScript,
    rejects: Rejects,
) -> int:
    """`Store.trim_rps`."""
    key = keys.rps(name)
    raw = await _read_bounded(script, key, name, "rps", rejects)
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
        rejects.reject(name, "rps", "not a unix second -> count in 0..1e9: deleted", malformed)
    if not old:
        return 0
    with redis_errors():
        deleted: int = await redis.hdel(key, *old)
    return deleted


async def read_inflight(
    redis: aioredis.Redis, keys: Keys, name: str, script: AsyncScript, rejects: Rejects
) -> dict[str, InflightEntry]:
    """`Store.read_inflight`: fields that do not decode are skipped and deleted."""
    key = keys.inflight(name)
    raw = await _read_bounded(script, key, name, "inflight", rejects)
    entries, skipped = decode_inflight(name, raw, rejects)
    if skipped:
        with redis_errors():
            await redis.hdel(key, *skipped)
    return entries


async def read_proxies(
    redis: aioredis.Redis,
    keys: Keys,
    name: str,
    script: AsyncScript,
    rejects: Rejects,
    *,
    now: float,
    stale_after: float,
) -> dict[str, ProxyHeartbeat]:
    """`Store.read_proxies`: live heartbeats; entries stale at `now`, and fields that do
    not decode, are deleted."""
    key = keys.proxies(name)
    raw = await _read_bounded(script, key, name, "proxies", rejects)
    decoded, stale = decode_heartbeats(name, raw, rejects)
    beats: dict[str, ProxyHeartbeat] = {}
    for proxy_id, beat in decoded.items():
        if now - beat.seen_at > stale_after:
            stale.append(proxy_id)
        else:
            beats[proxy_id] = beat
    if stale:
        with redis_errors():
            await redis.hdel(key, *stale)
    return dict(sorted(beats.items()))


async def write_autoscaler(
    redis: aioredis.Redis, keys: Keys, name: str, status: AutoscalerStatus
) -> None:
    """`Store.write_autoscaler`."""
    with redis_errors():
        await redis.set(keys.autoscaler(name), ENCODER.encode(status))


async def read_autoscaler(redis: aioredis.Redis, keys: Keys, name: str) -> AutoscalerStatus | None:
    """`Store.read_autoscaler`."""
    with redis_errors():
        raw = await redis.get(keys.autoscaler(name))
    if raw is None:
        return None
    try:
        return AUTOSCALER_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
