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

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from controlplane.errors import redis_errors
from controlplane.store.untrusted import Rejects, parse_nudge
from proxy.wire.keys import Keys
from proxy.wire.telemetry import Nudge, encode_nudge

log = logging.getLogger("sluice.store")


async def subscribe_control(
    redis: aioredis.Redis, keys: Keys, rejects: Rejects
) -> ControlSubscription:
    """`Store.subscribe_control`."""
    pubsub = redis.pubsub()
    with redis_errors():
        try:
            await pubsub.subscribe(keys.control)
        except BaseException:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            raise
    return ControlSubscription(pubsub, rejects)


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

    def __init__(self, pubsub: Any, rejects: Rejects) -> None:
        self._pubsub = pubsub
        self._rejects = rejects

    async def get(self, timeout: float) -> Nudge | None:  # noqa: ASYNC109 (redis-py's own)
        """The next nudge, or None if none arrives within `timeout` seconds.

        A message that is not a nudge naming a well-formed service name is skipped
        (None), counted and logged once a minute (untrusted.parse_nudge): anyone with a
        proxy's Redis user publishes here.
        """
        with redis_errors():
            message = await self._pubsub.get_message(
                ignore_subscribe_messages=True, timeout=max(0.0, timeout)
            )
        if message is None or message.get("type") != "message":
            return None
        return parse_nudge(message.get("data"), self._rejects)

    async def aclose(self) -> None:
        """Unsubscribe and release the connection."""
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()
