"""A real headless Chromium driven over the DevTools protocol (aiohttp's websocket client;
no other dependency), for the dashboard's browser tests.

    async with Chromium.launch(tmp_path) as browser:      # skips if no chromium
        page = await browser.new_page(width=1366, height=900)
        await page.goto("http://127.0.0.1:PORT/")
        title = await page.evaluate("document.title")
        await page.screenshot(path)
        assert page.console_errors == []

`console_errors` gathers what the page's own console would show as an error:
console.error/assert calls (Runtime.consoleAPICalled), uncaught exceptions
(Runtime.exceptionThrown) and browser log entries of level error (Log.entryAdded:
failed loads, CSP violations). Chromium runs with its own profile directory and a
free debugging port, and is killed by pid (with its children) on the way out.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.pids import descendants, kill_all
from tests.support.poll import until
from tests.support.ports import HOST, free_port

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-default-apps", "--mute-audio",
         "--hide-scrollbars")  # fmt: skip


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


class Page:
    """One tab: commands with replies, and the console errors seen so far."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._waiters: list[tuple[str, asyncio.Future[dict[str, Any]]]] = []
        self.console_errors: list[str] = []
        self._reader = asyncio.create_task(self._read(), name="cdp-reader")

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
                continue
            method, params = data.get("method", ""), data.get("params", {})
            self._note(method, params)
            for name, fut in list(self._waiters):
                if name == method and not fut.done():
                    fut.set_result(params)
                    self._waiters.remove((name, fut))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("DevTools connection closed"))

    def _note(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = params.get("args", [])
            self.console_errors.append(
                "console: " + " ".join(str(a.get("value", a.get("description"))) for a in args)
            )
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exc = details.get("exception", {})
            self.console_errors.append(f"exception: {exc.get('description') or details}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.console_errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")

    async def send(self, method: str, params: dict[str, Any] | None = None,
                   timeout: float = 15.0) -> dict[str, Any]:  # fmt: skip
        msg_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        await self._ws.send_str(json.dumps({"id": msg_id, "method": method,
                                            "params": params or {}}))  # fmt: skip
        async with asyncio.timeout(timeout):
            reply = await fut
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def goto(self, url: str, timeout: float = 15.0) -> None:
        """Navigate and wait for the load event."""
        loaded: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters.append(("Page.loadEventFired", loaded))
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise RuntimeError(f"navigate {url}: {result['errorText']}")
        async with asyncio.timeout(timeout):
            await loaded

    async def evaluate(self, expression: str) -> Any:
        """The value of a JS expression (promises awaited), or the exception it threw."""
        result = await self.send("Runtime.evaluate", {"expression": expression,
                                 "returnByValue": True, "awaitPromise": True})  # fmt: skip
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, *, timeout: float = 15.0, what: str = "") -> Any:
        """Poll a JS expression until it is truthy; its value."""
        return await until(lambda: self.evaluate(expression), timeout=timeout,
                           what=what or expression, interval=0.1)  # fmt: skip

    async def color_scheme(self, scheme: str) -> None:
        await self.send("Emulation.setEmulatedMedia",
                        {"features": [{"name": "prefers-color-scheme", "value": scheme}]})

    async def screenshot(self, path: Path) -> Path:
        data = await self.send("Page.captureScreenshot", {"format": "png"})
        png = base64.b64decode(data["data"])
        await asyncio.to_thread(_write, path, png)
        return path

    async def aclose(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._ws.close()


class Chromium:
    """A headless Chromium process with a DevTools endpoint on a free port."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int,
                 session: aiohttp.ClientSession) -> None:  # fmt: skip
        self.proc = proc
        self.port = port
        self._session = session
        self._pages: list[Page] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, tmp: Path) -> AsyncIterator[Chromium]:
        binary = chromium_binary()
        if binary is None:
            pytest.skip("no chromium (Debian: apt-get install chromium): browser tests skipped")
        port = free_port()
        profile = tmp / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        log = (tmp / "chromium.log").open("wb")
        argv = [binary, *FLAGS, f"--user-data-dir={profile}",
                f"--remote-debugging-port={port}", "--remote-debugging-address=" + HOST,
                "about:blank"]  # fmt: skip
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(sock_connect=5, sock_read=15))
        browser = cls(proc, port, session)
        try:
            await until(browser._answers, timeout=30, what="chromium's DevTools endpoint",
                        interval=0.1)  # fmt: skip
            yield browser
        finally:
            for page in browser._pages:
                with contextlib.suppress(Exception):
                    await page.aclose()
            await session.close()
            kids = descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                kill_all([proc.pid, *kids])
                proc.wait(5)
            kill_all([pid for pid in kids if pid != proc.pid])
            log.close()

    async def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {self.proc.returncode}")
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with self._session.get(f"http://{HOST}:{self.port}/json/version") as resp:
                return resp.status == 200
        return False

    async def new_page(self, *, width: int = 1366, height: int = 900) -> Page:
        async with self._session.put(f"http://{HOST}:{self.port}/json/new?about:blank") as resp:
            target = await resp.json()
        ws = await self._session.ws_connect(
            target["webSocketDebuggerUrl"], max_msg_size=0,
            timeout=aiohttp.ClientWSTimeout(ws_close=5),
        )  # fmt: skip
        page = Page(ws)
        self._pages.append(page)
        for domain in ("Page.enable", "Runtime.enable", "Log.enable"):
            await page.send(domain)
        await page.send("Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1,
                         "mobile": False})  # fmt: skip
        return page
