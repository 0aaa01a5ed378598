"""Following a service's snapshots in Redis: the one implementation of the contract's
read rule, used by the proxy's Redis source and by the control plane's
`Store.follow_snapshots`.

The rule (docs/architecture.md states it for the Redis source):

1. SUBSCRIBE to `{prefix}:svc:{name}:ready` and wait for the server's confirmation;
2. only then GET `{prefix}:svc:{name}:snapshot`, so no commit falls between the two;
3. then take each published payload, and GET again every `resync_interval` seconds
   (pub/sub is at-most-once; a message lost is recovered this way);
4. apply a snapshot only when it is newer than the one in force.

`SnapshotFeed` does steps 1-3 over one connection and hands back raw payloads,
tagged with how they came (published or stored); what "newer" means is the
caller's (the proxy's ReadySet also follows a Redis that went back in time, see
proxy/sources/redis.py). `newer_snapshots` adds step 4 the plain way: decode,
skip invalid payloads, yield generations above the last one yielded.

Errors: redis-py's own propagate unchanged (each caller translates them at its
boundary); `SnapshotFeed.subscribe` raises asyncio.TimeoutError when no
confirmation comes in time, which `newer_snapshots` turns into NoSubscribeConfirmation.

Imports nothing but the standard library and this package (redis-py's types only
for the type checker): the client is handed in.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, NamedTuple

from proxy.wire.errors import SluiceError, SnapshotInvalid
from proxy.wire.keys import Keys
from proxy.wire.snapshot import ReadySnapshot, decode_snapshot

if TYPE_CHECKING:
    import redis.asyncio as aioredis


class NoSubscribeConfirmation(SluiceError):
    """Redis did not confirm the subscription to the ready channel in time."""


class Delivery(NamedTuple):
    """A snapshot payload as it came: published on the channel, or read by a GET."""

    payload: bytes
    via_publish: bool


class SnapshotFeed:
    """Steps 1-3 of the read rule over one pub/sub connection; see the module doc.

        feed = SnapshotFeed(client, keys, "llm", resync_interval=5.0)
        try:
            await feed.subscribe(within=2.0)
            stored = await feed.get()          # step 2 (also schedules the next re-GET)
            while True:
                delivery = await feed.next()   # step 3: a message, or the due re-GET
        finally:
            await feed.aclose()
    """

    def __init__(
        self, client: aioredis.Redis, keys: Keys, service: str, *, resync_interval: float
    ) -> None:
        self._client = client
        self._channel = keys.ready(service)
        self._snapshot_key = keys.snapshot(service)
        self._resync_interval = resync_interval
        self._pubsub: Any = None
        self._next_resync = 0.0  # loop time of the next re-GET; 0: at once

    async def subscribe(self, within: float) -> None:
        """SUBSCRIBE and wait up to `within` seconds for the server's confirmation
        (asyncio.TimeoutError without it): only then may the GET follow."""
        self._pubsub = self._client.pubsub()
        await self._pubsub.subscribe(self._channel)
        await asyncio.wait_for(self._confirmed(within), within)

    async def _confirmed(self, poll: float) -> None:
        while True:
            message = await self._pubsub.get_message(timeout=poll)
            if message is not None and message["type"] == "subscribe":
                return

    async def get(self) -> bytes | None:
        """GET the stored snapshot (None: no key); the next re-GET is due
        `resync_interval` seconds from now."""
        payload = await self._client.get(self._snapshot_key)
        self._next_resync = asyncio.get_running_loop().time() + self._resync_interval
        return None if payload is None else _raw(payload)

    async def next(self) -> Delivery | None:
        """The stored snapshot when the re-GET is due, else the next published payload
        (waiting at most until the re-GET is due); None when neither came."""
        loop = asyncio.get_running_loop()
        if loop.time() >= self._next_resync:
            payload = await self.get()
            return None if payload is None else Delivery(payload, via_publish=False)
        wait = max(0.0, self._next_resync - loop.time())
        message = await self._pubsub.get_message(timeout=wait)
        if message is not None and message["type"] == "message":
            return Delivery(_raw(message["data"]), via_publish=True)
        return None

    async def aclose(self) -> None:
        """Unsubscribe and release the connection; never raises."""
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()


async def newer_snapshots(
    client: aioredis.Redis,
    keys: Keys,
    service: str,
    *,
    resync_interval: float,
    subscribe_timeout: float,
) -> AsyncGenerator[ReadySnapshot, None]:
    """Yield the stored snapshot of `service` (if any), then each newer one as committed.

    A payload that does not decode is skipped (the next one may be fine). Runs until
    the consumer stops iterating; raises NoSubscribeConfirmation when Redis does not
    confirm the subscription within `subscribe_timeout`, and redis-py's errors when
    Redis cannot be reached or the connection drops.
    """
    feed = SnapshotFeed(client, keys, service, resync_interval=resync_interval)
    current = -1
    try:
        try:
            await feed.subscribe(subscribe_timeout)
        except asyncio.TimeoutError as exc:
            raise NoSubscribeConfirmation("no subscribe confirmation") from exc
        while True:
            delivery = await feed.next()
            if delivery is None:
                continue
            try:
                snapshot = decode_snapshot(delivery.payload)
            except SnapshotInvalid:
                continue
            if snapshot.generation > current:
                current = snapshot.generation
                yield snapshot
    finally:
        await feed.aclose()


def _raw(payload: bytes | str | memoryview) -> bytes:
    return payload.encode() if isinstance(payload, str) else bytes(payload)
