"""The controller's leader lease, whole: the Lua scripts, acquire/renew/release, the
holder ids, and the loop a leader runs under it.

The lease is one Redis string, `{prefix}:leader` (`Keys.leader`), holding the holder
id with a TTL. Only its holder extends or deletes it (the scripts compare the value
first), so a paused leader whose lease expired cannot take it back from a successor.
Fencing: a store built with `fence=HOLDER` refuses to commit unless the lease holds
HOLDER (checked inside the commit's transaction, controlplane/store/commit.py), raising
LeaseLost.

    Lease(redis, key, holder, ttl)     the lease as one holder takes it (`Store.lease`)
    acquire(lease)                     wait until the lease is ours
    lead(lease, run)                   run `run()` while renewing; return when it is lost

Imports only controlplane.errors (and redis-py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis

from controlplane.errors import LeaseLost, StoreError, redis_errors
from proxy.stopping import RECANCEL

# The lease's lines are the controller's: operators filter on one logger name.
log = logging.getLogger("sluice.controller")

#: Seconds a cancelled run loop has to end before it is logged and cancelled again (more
#: than the 5 s its own clean-up may take: Controller.run's STOP_WITHIN).
STOP_SLOW = 6.0

# KEYS[1]: the lease key. ARGV[1]: the holder id, ARGV[2]: the TTL in milliseconds.
# Take the lease if it is free, extend it if ARGV[1] holds it; 1 if ARGV[1] holds it now.
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# KEYS[1]: the lease key. ARGV[1]: the holder id, ARGV[2]: the TTL in milliseconds.
# Extend the lease only if ARGV[1] holds it; 1 if extended.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# KEYS[1]: the lease key. ARGV[1]: the holder id.
# Delete the lease only if ARGV[1] holds it; 1 if deleted.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _ms(seconds: float) -> int:
    if seconds <= 0:
        raise ValueError(f"lease ttl must be > 0, got {seconds}")
    return max(1, round(seconds * 1000))


class Lease:
    """The leader lease at `key`, as `holder` takes it for `ttl` seconds: one object in
    the style of redis-py's asyncio `Lock`, owning its scripts (registered here, no I/O
    yet), its token (`holder`) and its TTL. `Store.lease(holder, ttl)` makes one on the
    store's client and key.

    Every method raises StoreUnavailable/StoreError (`redis_errors`); `acquire` and
    `extend` raise ValueError for a TTL that is not positive.
    """

    def __init__(self, redis: aioredis.Redis, key: str, holder: str, ttl: float) -> None:
        self.redis = redis
        self.key = key
        self.holder = holder
        self.ttl = ttl
        self._acquire = redis.register_script(_ACQUIRE)
        self._extend = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def acquire(self) -> bool:
        """Take the lease for `ttl` seconds if free, or extend it if `holder` already has
        it. True when `holder` holds it afterwards."""
        with redis_errors():
            got = await self._acquire(keys=[self.key], args=[self.holder, _ms(self.ttl)])
        return bool(got)

    async def extend(self) -> bool:
        """Extend the lease to `ttl` seconds from now, only if `holder` holds it."""
        with redis_errors():
            got = await self._extend(keys=[self.key], args=[self.holder, _ms(self.ttl)])
        return bool(got)

    async def release(self) -> bool:
        """Give the lease up, only if `holder` holds it. True if it was released."""
        with redis_errors():
            got = await self._release(keys=[self.key], args=[self.holder])
        return bool(got)

    async def owner(self) -> str | None:
        """Who holds the lease now (maybe not `holder`), or None."""
        with redis_errors():
            raw = await self.redis.get(self.key)
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


# -- holder ids --------------------------------------------------------------------------------


def default_holder() -> str:
    """A lease holder name unique to this process: host:pid:random."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def unique_holder(name: str | None) -> str:
    """The lease holder id of this process: `name` (default host:pid) plus a random
    token, so that two controllers given the same `--holder` never both lead."""
    if name is None:
        return default_holder()
    return f"{name}:{uuid.uuid4().hex[:8]}"


# -- the leader's loop -------------------------------------------------------------------------


async def acquire(lease: Lease) -> None:
    """Wait until `lease.holder` holds the lease, trying every third of the TTL.

    Says once who holds it meanwhile; a Redis failure is logged and tried again.
    """
    said = False
    while True:
        try:
            if await lease.acquire():
                return
            if not said:
                log.info("controller %s: standing by (the lease is %s's)", lease.holder,
                         await lease.owner())  # fmt: skip
                said = True
        except StoreError as exc:
            log.warning("controller %s: lease: %s", lease.holder, exc)
        await asyncio.sleep(lease.ttl / 3)


async def renew(lease: Lease) -> bool | None:
    """Renew the lease: True if renewed, False if someone else holds it (or it expired),
    None if Redis did not answer within a third of the TTL."""
    try:
        async with asyncio.timeout(lease.ttl / 3):
            return await lease.extend()
    except (StoreError, TimeoutError) as exc:
        log.warning("controller %s: renewing the lease: %s", lease.holder,
                    str(exc) or type(exc).__name__)  # fmt: skip
        return None


async def lead(lease: Lease, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `run()` (in a task) while renewing the lease every third of the TTL; return
    when the lease is lost, `run()` having been cancelled and awaited.

    A renewal that does not answer within a third of the TTL counts as failed
    (a stalled Redis must not leave a leader acting on an expired lease), and
    the leader steps down (returns) once 0.6 TTL passed without a renewal, before the
    lease can have expired under it. `run()` raising LeaseLost (a commit refused by the
    fence) ends the lead at once, even while a renewal is still waiting for an answer;
    `run()` raising anything else is logged and propagates. A cancellation of this
    coroutine always propagates.
    """
    runner = asyncio.create_task(run(), name="controller")
    try:
        await _renew_while_running(lease, runner)
    finally:
        await _stop(lease, runner)
        failure = None if runner.cancelled() else runner.exception()
        if failure is not None and not isinstance(failure, LeaseLost):
            log.error("controller %s: run() failed", lease.holder, exc_info=runner.exception())


async def _stop(lease: Lease, runner: asyncio.Task[None]) -> None:
    """Cancel `runner` until it has ended: a library may swallow one cancel (redis-py
    does now and then), and the run loop would then go on while this leader stands by.
    No bound: the next lead must not begin beside it. asyncio.wait, not `await runner`:
    a cancellation of *this* task propagates (or SIGTERM would turn into "lost the
    lease" and the controller would lead again)."""
    runner.cancel()
    # First its own clean-up's time (it stops its helpers within 5 s): a second cancel
    # would cut that short.
    await asyncio.wait({runner}, timeout=STOP_SLOW)
    if runner.done():
        return
    log.warning("controller %s: its run loop is still running %.0fs after it was "
                "cancelled; cancelling again until it ends", lease.holder, STOP_SLOW)
    while not runner.done():
        runner.cancel()
        await asyncio.wait({runner}, timeout=RECANCEL)


async def _renew_while_running(lease: Lease, runner: asyncio.Task[None]) -> None:
    """`lead`'s loop: returns when the lease is lost or `runner` ended with LeaseLost."""
    ttl = lease.ttl
    last_renewed = time.monotonic()
    while True:
        done: set[asyncio.Task[Any]]
        done, _ = await asyncio.wait({runner}, timeout=ttl / 3)
        renewal: asyncio.Task[bool | None] | None = None
        if not done:
            renewal = asyncio.create_task(renew(lease))
            try:
                done, _ = await asyncio.wait({runner, renewal}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                renewal.cancel()
                await asyncio.wait({renewal})
        if runner in done or renewal is None:
            with contextlib.suppress(LeaseLost):
                runner.result()  # run() only ends by raising
            log.warning("controller %s: %s", lease.holder, runner.exception())
            return  # a commit was refused: the lease is someone else's
        renewed = renewal.result()
        if renewed is False:
            return  # someone else holds it, or it expired
        if renewed:
            last_renewed = time.monotonic()
        elif time.monotonic() - last_renewed > ttl * 0.6:
            return  # step down before the lease can expire under us
