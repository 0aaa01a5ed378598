"""Controllers run in the test's own loop, and proxies that follow a service in Redis.

`Controllers`: starts `Controller`s (each with its `run()` task) and owns them; `stop()`
one, `aclose()` all in reverse order at teardown. A stop that does not finish within
its bound prints every task's stack and fails, so a hung shutdown names itself.

`proxy_for(proxy_factory, redis_url, prefix, service, *extra)`: a sluice-proxy process
following `service` through Redis; returns its URL.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from controlplane.reconcile import Controller, ControllerConfig
from controlplane.store import Store
from tests.support.poll import must_finish
from tests.support.processes import ProxyFactory, WaitMode


class Controllers:
    """The controllers a test started; the fixture that made this closes them."""

    def __init__(self, *, stop_within: float = 30.0) -> None:
        self.stop_within = stop_within
        self._running: list[tuple[Controller, asyncio.Task[None]]] = []

    async def start(self, store: Store, config: ControllerConfig, **kwargs: Any) -> Controller:
        """`Controller(store, config, **kwargs)`, started, its run loop in a task."""
        controller = Controller(store, config, **kwargs)
        await controller.start()
        self._running.append((controller, asyncio.create_task(controller.run())))
        return controller

    async def stop(self, controller: Controller) -> None:
        """Cancel its run loop and close it (within `stop_within` seconds)."""
        for entry in [e for e in self._running if e[0] is controller]:
            self._running.remove(entry)
            await must_finish(_stop(*entry), "stopping a controller", self.stop_within)

    async def aclose(self) -> None:
        for controller, _task in reversed(list(self._running)):
            await self.stop(controller)


async def _stop(controller: Controller, task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await controller.aclose()


async def proxy_for(
    proxy_factory: ProxyFactory, redis_url: str, prefix: str, service: str, *extra: str,
    wait: WaitMode = "ready",
) -> str:  # fmt: skip
    """A sluice-proxy following `service` in the Redis at `redis_url`; returns its URL."""
    proxy = await proxy_factory.astart(
        "--redis", redis_url, "--service", service, "--redis-prefix", prefix,
        "--shutdown-grace", "1", *extra, wait=wait,
    )  # fmt: skip
    return proxy.url
