"""`serve`: the dashboard's poller and HTTP site on one store, until cancelled.

Start order: the first poll (so the first page has data, or the Redis error), the
poller's loop, the listener; stop order reversed: the listener (open event streams are
cut), the poller. The store is the caller's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from controlplane.dashboard.poller import Poller
from controlplane.dashboard.server import DashboardConfig, DashboardConfigError, make_app
from controlplane.store import Store


async def serve(
    store: Store, config: DashboardConfig, *, on_listening: Callable[[str], None] | None = None
) -> None:
    """Serve the dashboard of `store` until cancelled; `on_listening(url)` once bound."""
    ssl_context = config.ssl_context()
    poller = Poller(store, interval=config.interval)
    await poller.step()
    await poller.start()
    runner = web.AppRunner(make_app(poller, config), access_log=None,
                           shutdown_timeout=1.0)  # fmt: skip
    try:
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError as exc:
            raise DashboardConfigError(
                f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
            ) from exc
        if on_listening is not None:
            scheme = "https" if ssl_context else "http"
            host = f"[{config.host}]" if ":" in config.host else config.host
            port = runner.addresses[0][1] if runner.addresses else config.port  # --port 0
            on_listening(f"{scheme}://{host}:{port}/")
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await poller.aclose()
