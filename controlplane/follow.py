"""Follow one service's ready set from Redis: every new ReadySnapshot, in generation order.

`sluice snapshot NAME --watch` is built on `follow_snapshots`. It reads the way a
proxy does (DESIGN.md, "The wire contract"): subscribe to `{prefix}:svc:{name}:ready`
first, then GET `{prefix}:svc:{name}:snapshot`, and yield only snapshots whose
generation is above the last one yielded; GET again every `resync_interval`
(pub/sub is at-most-once). A payload that does not decode is skipped.

It is a reader of the two keys `controlplane.store.Keys` names; nothing here
writes. Connection failures surface as `StoreUnavailable` naming the URL, like
the store's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from controlplane.store import DEFAULT_PREFIX, Keys, StoreError, StoreUnavailable
from proxy.errors import SnapshotInvalid
from proxy.snapshot import ReadySnapshot, decode_snapshot


async def follow_snapshots(
    url: str,
    name: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    resync_interval: float = 5.0,
    connect_timeout: float = 5.0,
) -> AsyncGenerator[ReadySnapshot, None]:
    """Yield the current snapshot of `name` (if any), then each newer one as committed.

    Runs until cancelled (or the consumer stops iterating). Raises StoreUnavailable
    when Redis cannot be reached or the connection drops.
    """
    keys = Keys(prefix)
    client = aioredis.Redis.from_url(
        url, socket_connect_timeout=connect_timeout, socket_timeout=None
    )
    pubsub = client.pubsub()
    current = -1
    try:
        try:
            await pubsub.subscribe(keys.ready(name))
            # GET only once the server has registered the subscription, so that no
            # commit falls between the two.
            async with asyncio.timeout(connect_timeout):
                while True:
                    message = await pubsub.get_message(timeout=connect_timeout)
                    if message is not None and message["type"] == "subscribe":
                        break
            loop = asyncio.get_running_loop()
            next_resync = loop.time()
            while True:
                payload: bytes | str | None = None
                if loop.time() >= next_resync:
                    payload = await client.get(keys.snapshot(name))
                    next_resync = loop.time() + resync_interval
                else:
                    wait = max(0.0, next_resync - loop.time())
                    message = await pubsub.get_message(timeout=wait)
                    if message is not None and message["type"] == "message":
                        payload = message["data"]
                if payload is None:
                    continue
                try:
                    snapshot = decode_snapshot(payload)
                except SnapshotInvalid:
                    continue  # a bad payload changes nothing; the next one may be fine
                if snapshot.generation > current:
                    current = snapshot.generation
                    yield snapshot
        except (RedisConnectionError, RedisTimeoutError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis unavailable: {exc or type(exc).__name__}") from exc
        except RedisError as exc:
            raise StoreError(f"redis error: {exc}") from exc
    finally:
        with contextlib.suppress(Exception):
            await pubsub.aclose()  # type: ignore[no-untyped-call]
        await client.aclose()
