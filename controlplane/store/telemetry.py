"""What the store reads and writes beside the records: the audit events, the proxies'
request rates, in-flight counts and heartbeats, and the autoscaler's last decision.

None of it changes the ready set, so none of it goes through the commit transaction.
Values a proxy or a person wrote that do not decode are skipped (and logged where it
helps), never fatal: they only inform the autoscaler and `sluice status`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis

from controlplane.errors import redis_errors
from controlplane.records import AutoscalerStatus, Event
from controlplane.store.codec import (
    AUTOSCALER_DECODER,
    ENCODER,
    HEARTBEAT_DECODER,
    INFLIGHT_DECODER,
    parse_int,
    text,
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


async def read_rps(redis: aioredis.Redis, keys: Keys, name: str) -> dict[int, int]:
    """`Store.read_rps`."""
    with redis_errors():
        raw = await redis.hgetall(keys.rps(name))
    counts = {}
    for second, count in raw.items():
        parsed = parse_int(second), parse_int(count)
        if parsed[0] is None or parsed[1] is None:
            log.warning("service %s: ignoring a malformed rps field %r=%r", name,
                        second, count)  # fmt: skip
            continue
        counts[parsed[0]] = parsed[1]
    return dict(sorted(counts.items()))


async def read_rps_seconds(
    redis: aioredis.Redis, keys: Keys, name: str, seconds: list[int]
) -> dict[int, int]:
    """`Store.read_rps_seconds`: one HMGET, whatever the size of the hash."""
    if not seconds:
        return {}
    with redis_errors():
        raw = await redis.hmget(keys.rps(name), [str(s) for s in seconds])
    counts = {}
    for second, count in zip(seconds, raw, strict=True):
        parsed = None if count is None else parse_int(count)
        if parsed is not None:
            counts[second] = parsed
    return counts


async def trim_rps(redis: aioredis.Redis, keys: Keys, name: str, before: int) -> int:
    """`Store.trim_rps`."""
    key = keys.rps(name)
    with redis_errors():
        seconds = await redis.hkeys(key)
        old = []
        for raw in seconds:
            second = parse_int(raw)
            if second is None:
                log.warning("service %s: deleting a malformed rps field %r", name, raw)
            if second is None or second < before:
                old.append(raw)
        if not old:
            return 0
        deleted: int = await redis.hdel(key, *old)
    return deleted


async def read_inflight(redis: aioredis.Redis, keys: Keys, name: str) -> dict[str, InflightEntry]:
    """`Store.read_inflight`."""
    with redis_errors():
        raw = await redis.hgetall(keys.inflight(name))
    entries = {}
    for proxy_id, value in raw.items():
        try:
            entries[text(proxy_id)] = INFLIGHT_DECODER.decode(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            log.warning("service %s: ignoring an invalid in-flight entry", name)
    return entries


async def read_proxies(
    redis: aioredis.Redis, keys: Keys, name: str, *, now: float, stale_after: float
) -> dict[str, ProxyHeartbeat]:
    """`Store.read_proxies`: live heartbeats; entries stale at `now` are deleted."""
    key = keys.proxies(name)
    with redis_errors():
        raw = await redis.hgetall(key)
    beats: dict[str, ProxyHeartbeat] = {}
    stale: list[bytes | str] = []
    for proxy_id, value in raw.items():
        try:
            beat = HEARTBEAT_DECODER.decode(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            log.warning("service %s: ignoring an invalid proxy heartbeat", name)
            continue
        if now - beat.seen_at > stale_after:
            stale.append(proxy_id)
        else:
            beats[text(proxy_id)] = beat
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
