"""`run_controller`: the controller under the leader lease. It stands by until it holds
the lease, runs a `Controller` while it keeps it, and stands by again if it loses it.
The lease itself (acquire, renew, release, holder ids, the lead loop) is
controlplane/lease.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from controlplane import lease
from controlplane.backends.base import ReplicaBackend
from controlplane.reconcile.config import ControllerConfig
from controlplane.reconcile.loop import Controller
from controlplane.store import Store, StoreError

log = logging.getLogger("sluice.controller")


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
    holder = lease.unique_holder(config.holder)
    store = Store.from_url(
        config.redis_url, prefix=config.prefix, ca_file=config.redis_ca_file, fence=holder
    )
    leader = store.lease(holder, config.lease_ttl)
    try:
        while True:
            await lease.acquire(leader)
            log.info("controller %s: leading", holder)
            controller = Controller(store, config, backends=backends)
            stepping_down = False
            try:
                await controller.start()
                if started is not None:
                    started.set()
                await lease.lead(leader, controller.run)
                stepping_down = True  # lead returns only when the lease is lost
            finally:
                await controller.aclose(stepping_down=stepping_down)
            log.warning("controller %s: lost the lease; standing by", holder)
    finally:
        with contextlib.suppress(StoreError):
            await leader.release()
        await store.aclose()
