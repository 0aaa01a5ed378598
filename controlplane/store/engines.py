"""The engine view in Redis: the controller writes each service's `EngineView` (with a
TTL, so a view nobody refreshes disappears) and reads it back for the queue-length
autoscaler and `sluice status`. A view that does not parse is None; a field or record
that does not parse is dropped (proxy/wire/engines.py), and logged once per reader.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import redis.asyncio as aioredis

from controlplane.errors import redis_errors
from proxy.wire.engines import EngineView, decode_engine_view, encode_engine_view
from proxy.wire.keys import Keys

log = logging.getLogger("sluice.store")
_warned: set[str] = set()


async def write_engines(
    redis: aioredis.Redis, keys: Keys, views: Mapping[str, EngineView], ttl: float
) -> None:
    """`Store.write_engines`: every view in one round trip."""
    if not views:
        return
    with redis_errors():
        async with redis.pipeline(transaction=False) as pipe:
            for name, view in views.items():
                pipe.set(keys.engines(name), encode_engine_view(view), px=max(1, int(ttl * 1000)))
            await pipe.execute()


async def read_engines(redis: aioredis.Redis, keys: Keys, name: str) -> EngineView | None:
    """`Store.read_engines`."""
    with redis_errors():
        raw = await redis.get(keys.engines(name))
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
