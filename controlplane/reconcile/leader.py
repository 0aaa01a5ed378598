"""The leader lease around a controller: `run_controller` stands by until it holds
the lease, runs a `Controller` while it keeps it, and stands by again if it loses it.

Moved verbatim from controlplane/controller.py; controlplane/lease.py (acquire,
renew, release, fencing in one place) replaces the lease calls here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

from controlplane.backends.base import ReplicaBackend
from controlplane.reconcile.config import ControllerConfig
from controlplane.reconcile.loop import Controller
from controlplane.store import LeaseLost, Store, StoreError

log = logging.getLogger("sluice.controller")


# -- the leader lease --------------------------------------------------------------------------


def default_holder() -> str:
    """A lease holder name unique to this process: host:pid:random."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def unique_holder(name: str | None) -> str:
    """The lease holder id of this process: `name` (default host:pid) plus a random
    token, so that two controllers given the same `--holder` never both lead."""
    if name is None:
        return default_holder()
    return f"{name}:{uuid.uuid4().hex[:8]}"


async def run_controller(
    config: ControllerConfig,
    *,
    started: asyncio.Event | None = None,
    backends: Mapping[str, ReplicaBackend] | None = None,
) -> None:
    """Run a controller until cancelled, leading only while holding the leader lease.

    Stands by (polling the lease every third of its TTL) until it acquires it;
    then starts a Controller, sets `started`, and renews the lease every third
    of its TTL. If renewal fails, a commit finds the lease gone (LeaseLost: the
    store is fenced by this holder), or Redis stays unreachable for most of a
    TTL, it stops the controller (replicas keep running) and stands by again. On
    cancellation it closes the controller and releases the lease, so a standby
    takes over at once. The holder id is `config.holder` plus a random token.
    """
    holder = unique_holder(config.holder)
    store = Store.from_url(
        config.redis_url, prefix=config.prefix, ca_file=config.redis_ca_file, fence=holder
    )
    try:
        while True:
            await _acquire(store, holder, config.lease_ttl)
            log.info("controller %s: leading", holder)
            controller = Controller(store, config, backends=backends)
            stepping_down = False
            try:
                await controller.start()
                if started is not None:
                    started.set()
                await _lead(store, holder, config.lease_ttl, controller)
                stepping_down = True  # _lead returns only when the lease is lost
            finally:
                await controller.aclose(stepping_down=stepping_down)
            log.warning("controller %s: lost the lease; standing by", holder)
    finally:
        with contextlib.suppress(StoreError):
            await store.release_lease(holder)
        await store.aclose()


async def _renew(store: Store, holder: str, ttl: float) -> bool | None:
    """Renew the lease: True if renewed, False if someone else holds it (or it expired),
    None if Redis did not answer within a third of the TTL."""
    try:
        async with asyncio.timeout(ttl / 3):
            return await store.renew_lease(holder, ttl)
    except (StoreError, TimeoutError) as exc:
        log.warning("controller %s: renewing the lease: %s", holder,
                    str(exc) or type(exc).__name__)  # fmt: skip
        return None


async def _acquire(store: Store, holder: str, ttl: float) -> None:
    said = False
    while True:
        try:
            if await store.acquire_lease(holder, ttl):
                return
            if not said:
                log.info("controller %s: standing by (the lease is %s's)", holder,
                         await store.lease_holder())  # fmt: skip
                said = True
        except StoreError as exc:
            log.warning("controller %s: lease: %s", holder, exc)
        await asyncio.sleep(ttl / 3)


async def _lead(store: Store, holder: str, ttl: float, controller: Controller) -> None:
    """Run the controller while renewing the lease; return when the lease is lost.

    A renewal that does not answer within a third of the TTL counts as failed
    (a stalled Redis must not leave a leader acting on an expired lease), and
    the leader steps down before the lease can have expired under it. A commit
    refused by the fence (LeaseLost) ends `run()`: the leader steps down at once,
    even while a renewal is still waiting for an answer. A cancellation of this
    coroutine always propagates.
    """
    runner = asyncio.create_task(controller.run(), name="controller")
    last_renewed = time.monotonic()
    try:
        while True:
            done: set[asyncio.Task[Any]]
            done, _ = await asyncio.wait({runner}, timeout=ttl / 3)
            renewal: asyncio.Task[bool | None] | None = None
            if not done:
                renewal = asyncio.create_task(_renew(store, holder, ttl))
                try:
                    done, _ = await asyncio.wait(
                        {runner, renewal}, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    renewal.cancel()
                    await asyncio.wait({renewal})
            if runner in done or renewal is None:
                with contextlib.suppress(LeaseLost):
                    runner.result()  # run() only ends by raising
                log.warning("controller %s: %s", holder, runner.exception())
                return  # a commit was refused: the lease is someone else's
            renewed = renewal.result()
            if renewed is False:
                return  # someone else holds it, or it expired
            if renewed:
                last_renewed = time.monotonic()
            elif time.monotonic() - last_renewed > ttl * 0.6:
                return  # step down before the lease can expire under us
    finally:
        runner.cancel()
        # asyncio.wait (not `await runner` under suppress): a cancellation of *this*
        # task must propagate, or SIGTERM would turn into "lost the lease" and the
        # controller would lead again.
        await asyncio.wait({runner})
        failure = None if runner.cancelled() else runner.exception()
        if failure is not None and not isinstance(failure, LeaseLost):
            log.error("controller %s: run() failed", holder, exc_info=runner.exception())
