"""Open-loop HTTP load for the controller tests: a fixed request rate, every request
timed, whatever the replies do (a hung request does not slow the others down).

    async with Traffic(proxy.url, rate=20) as traffic:
        ...  # change the service
    assert traffic.failures() == []
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class Outcome:
    started: float  # monotonic
    status: int  # -1: no HTTP answer (the error is in `error`)
    latency: float
    replica: str | None  # the X-Replica-Id header
    error: str | None = None


class Traffic:
    """GET `path` on `url` at `rate` requests per second until the context exits."""

    def __init__(
        self, url: str, *, rate: float = 20.0, path: str = "/fast", timeout: float = 15.0
    ) -> None:
        self.url = url.rstrip("/") + path
        self.rate = rate
        self.timeout = timeout
        self.outcomes: list[Outcome] = []
        self._session: aiohttp.ClientSession | None = None
        self._driver: asyncio.Task[None] | None = None
        self._requests: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Traffic:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self._driver = asyncio.create_task(self._drive())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._driver is not None and self._session is not None
        self._driver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._driver
        if self._requests:  # let the ones in flight finish: their outcome counts
            await asyncio.wait(self._requests, timeout=self.timeout + 1)
        for task in self._requests:
            task.cancel()
        await self._session.close()

    async def _drive(self) -> None:
        period = 1.0 / self.rate
        start = time.monotonic()
        n = 0
        while True:
            task = asyncio.create_task(self._one())
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)
            n += 1
            await asyncio.sleep(max(0.0, start + n * period - time.monotonic()))

    async def _one(self) -> None:
        assert self._session is not None
        started = time.monotonic()
        try:
            async with self._session.get(self.url) as resp:
                await resp.read()
                self.outcomes.append(
                    Outcome(started, resp.status, time.monotonic() - started,
                            resp.headers.get("X-Replica-Id"))
                )  # fmt: skip
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.outcomes.append(Outcome(started, -1, time.monotonic() - started, None, repr(exc)))

    def failures(self) -> list[Outcome]:
        """Requests that did not answer 2xx."""
        return [o for o in self.outcomes if not 200 <= o.status < 300]

    def slower_than(self, seconds: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.latency > seconds]
