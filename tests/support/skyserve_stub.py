"""A stub Sky Serve controller speaking the load-balancer sync protocol (a named fake:
the real controller needs a cloud). It records every timestamp it receives and
answers from a script: a list of replica sets, the last one repeated; it can be
told to fail or to delay its answers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class StubController:
    # Each entry: replica url -> gpu_type. The last entry repeats forever.
    script: list[dict[str, str]] = field(default_factory=list)
    fail: int = 0  # answer this many syncs with HTTP 500 (after reading them)
    delay: float = 0.0
    timestamps: list[float] = field(default_factory=list)
    syncs: int = 0
    peers: list[tuple[str, int]] = field(default_factory=list)  # client address per sync
    sync_times: list[float] = field(default_factory=list)  # monotonic, per sync received
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    url: str = ""

    async def _sync(self, request: web.Request) -> web.Response:
        body: Any = await request.json()
        transport = request.transport
        self.peers.append(transport.get_extra_info("peername")[:2] if transport else ("", 0))
        self.sync_times.append(time.monotonic())
        if self.delay:
            await asyncio.sleep(self.delay)
        self.syncs += 1
        self.synced.set()
        if self.fail > 0:
            self.fail -= 1
            return web.Response(status=500, text="stub failure")
        # Only a sync that succeeded counts its timestamps as delivered.
        self.timestamps.extend(body["request_aggregator"]["timestamps"])
        current = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        info = {url: {"gpu_type": gpu} for url, gpu in current.items()}
        return web.json_response({"replica_info": info})

    async def start(self, port: int) -> None:
        app = web.Application()
        app.router.add_post("/controller/load_balancer_sync", self._sync)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def wait_syncs(self, n: int, timeout: float = 10.0) -> None:
        """Wait until at least n more syncs have been answered."""
        target = self.syncs + n
        async with asyncio.timeout(timeout):
            while self.syncs < target:
                self.synced.clear()
                await self.synced.wait()

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
