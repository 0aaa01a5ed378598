"""The store's control channel: nudges to the controller (`nudge`,
`ControlSubscription`). Following a service's snapshots is `Store.follow_snapshots`
(on proxy.wire.feed, as a proxy follows them).

Pub/sub is at-most-once: a nudge only makes the controller act sooner (it reconciles
on its own interval anyway).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from controlplane.errors import redis_errors
from proxy.wire.keys import Keys
from proxy.wire.telemetry import Nudge, decode_nudge, encode_nudge

log = logging.getLogger("sluice.store")


async def subscribe_control(redis: aioredis.Redis, keys: Keys) -> ControlSubscription:
    """`Store.subscribe_control`."""
    pubsub = redis.pubsub()
    with redis_errors():
        try:
            await pubsub.subscribe(keys.control)
        except BaseException:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            raise
    return ControlSubscription(pubsub)


async def nudge(redis: aioredis.Redis, keys: Keys, name: str, reason: str) -> int:
    """`Store.nudge`."""
    with redis_errors():
        receivers: int = await redis.publish(
            keys.control, encode_nudge(Nudge(service=name, reason=reason))
        )
    return receivers


class ControlSubscription:
    """Nudges arriving on the control channel (from `Store.subscribe_control`).

    Pub/sub is at-most-once: a nudge only makes the controller act sooner, it
    reconciles on its own interval anyway.
    """

    def __init__(self, pubsub: Any) -> None:
        self._pubsub = pubsub

    async def get(self, timeout: float) -> Nudge | None:  # noqa: ASYNC109 (redis-py's own)
        """The next nudge, or None if none arrives within `timeout` seconds.

        A message that is not a nudge is logged and skipped (None).
        """
        with redis_errors():
            message = await self._pubsub.get_message(
                ignore_subscribe_messages=True, timeout=max(0.0, timeout)
            )
        if message is None or message.get("type") != "message":
            return None
        try:
            return decode_nudge(message["data"])
        except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
            log.warning("ignoring an invalid nudge: %s", exc)
            return None

    async def aclose(self) -> None:
        """Unsubscribe and release the connection."""
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()
