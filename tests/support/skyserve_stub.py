"""A stub Sky Serve controller speaking the load-balancer sync protocol (a named fake:
the real controller needs a cloud).

`StubController`: in the test's loop; it records every timestamp it receives and
answers from a script: a list of replica sets, the last one repeated; it can be
told to fail or to delay its answers. The `stub` fixture (a plugin fixture:
tests/conftest.py) is one on a free port.

`threaded_stub_code(port, replica_url)`: Python source that starts the same protocol's
simplest answer (one replica, gpu_type A100) in a thread, for a child process that
runs Sky Serve's own `run_load_balancer` and so has no loop of the test's.
"""

from __future__ import annotations

import asyncio
import textwrap
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from tests.support.ports import free_port


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


def threaded_stub_code(port: int, replica_url: str) -> str:
    """Source for a child: a stub controller on 127.0.0.1:`port`, serving in a thread,
    whose every sync answers one replica, `replica_url`, with gpu_type A100."""
    return textwrap.dedent(f"""
        import json, threading, http.server
        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers['Content-Length']))
                body = json.dumps({{"replica_info": {{"{replica_url}": {{"gpu_type": "A100"}}}}}})
                self.send_response(200); self.send_header('Content-Length', str(len(body)))
                self.end_headers(); self.wfile.write(body.encode())
            def log_message(self, *a): pass
        srv = http.server.ThreadingHTTPServer(('127.0.0.1', {port}), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    """)


@pytest.fixture
async def stub() -> AsyncIterator[StubController]:
    """A StubController serving on a free port, closed after the test."""
    controller = StubController()
    await controller.start(free_port())
    try:
        yield controller
    finally:
        await controller.aclose()
