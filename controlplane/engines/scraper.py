"""`EngineScraper`: the controller reads every READY replica's metrics page on its
service's interval and publishes one compact `EngineView` per service for every proxy
(`{prefix}:svc:{name}:engines`, with a TTL).

Why the controller and not each proxy: a page costs the engine a render and the
reader a parse; with P proxies (and `--workers` processes each) proxy-side scraping
multiplies both by P for the same numbers, and P proxies would each see a different
moment. One scraper per fleet costs one GET per replica per interval, and its view is
the same for everyone (docs/architecture.md).

Bounds (100 replicas at 1 s cost about a GET and a filtered parse each): at most
`concurrency` scrapes at once; each has a timeout (`timeout`, at most the interval);
a page larger than `max_bytes` is not parsed; a replica whose scrape fails is asked
again after 2, 4, ... up to `MAX_BACKOFF` seconds (a plain HTTP app without metrics
costs one GET every 30 s). Nothing here can affect serving: a failure makes the
replica's record "unknown" (with `error` set), never more.

Drive it with `step()` (tests) or `run()`; `track()` tells it, after every
reconcile step, which replicas of a service are READY and how to scrape them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from controlplane.engines.parse import Sample, parse_metrics, summarize
from controlplane.store import Store
from proxy.stopping import cancel_requested
from proxy.wire.engines import EngineStats, EngineView

log = logging.getLogger("sluice.engines")

MAX_BACKOFF = 30.0
#: A published view outlives its last refresh by this many intervals (then expires).
VIEW_TTL_INTERVALS = 5.0
MIN_VIEW_TTL = 5.0


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One READY replica to scrape: where, and how often."""

    replica_id: int
    url: str
    path: str = "/metrics"
    interval: float = 1.0


@dataclass(slots=True)
class _State:
    target: ScrapeTarget
    due: float = 0.0
    failures: int = 0
    sample: Sample | None = None
    sampled_at: float = 0.0
    stats: EngineStats | None = None
    capacity: int | None = None  # llama.cpp: from /props, read once
    slots: int | None = None
    props_read: bool = False


class EngineScraper:
    """Scrapes engines and publishes their views; see the module docstring."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], float] = time.time,
        concurrency: int = 16,
        timeout: float = 2.0,
        max_bytes: int = 1 << 20,
    ) -> None:
        self._store = store
        self._clock = clock
        self._concurrency = concurrency
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._session: aiohttp.ClientSession | None = None
        self._services: dict[str, dict[int, _State]] = {}
        self.scrapes = 0  # scrapes attempted (tests, diagnostics)

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._concurrency, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None),
                auto_decompress=True,
            )

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # -- what to scrape -------------------------------------------------------------------

    def track(self, service: str, targets: Iterable[ScrapeTarget]) -> None:
        """The READY replicas of `service` now; others are forgotten (a replica that comes
        back starts afresh), a moved URL or changed path is scraped afresh."""
        old = self._services.get(service, {})
        new: dict[int, _State] = {}
        for target in targets:
            state = old.get(target.replica_id)
            if state is None or state.target.url != target.url or state.target.path != target.path:
                state = _State(target)
            else:
                state.target = target
            new[target.replica_id] = state
        if new:
            self._services[service] = new
        else:
            self._services.pop(service, None)

    def forget(self, service: str) -> None:
        self._services.pop(service, None)

    def view(self, service: str) -> EngineView:
        """What was last scraped of `service` (published with the next step)."""
        states = self._services.get(service, {})
        return EngineView(
            service=service,
            at=self._clock(),
            replicas={str(rid): s.stats for rid, s in states.items() if s.stats is not None},
        )

    # -- scraping -------------------------------------------------------------------------

    def next_due(self) -> float | None:
        dues = [s.due for states in self._services.values() for s in states.values()]
        return min(dues) if dues else None

    async def step(self) -> None:
        """Scrape every replica that is due (bounded concurrency), then publish the view
        of every service that had one scraped."""
        await self.start()
        now = self._clock()
        due = [
            (service, state)
            for service, states in self._services.items()
            for state in states.values()
            if state.due <= now
        ]
        if not due:
            return
        gate = asyncio.Semaphore(self._concurrency)

        async def one(state: _State) -> None:
            async with gate:
                await self._scrape(state)

        await asyncio.gather(*(one(state) for _, state in due))
        touched = {service for service, _ in due}
        views = {name: self.view(name) for name in touched if name in self._services}
        if views:
            interval = min(s.target.interval for n in views for s in self._services[n].values())
            ttl = max(MIN_VIEW_TTL, VIEW_TTL_INTERVALS * interval)
            await self._store.telemetry.write_engines(views, ttl)

    async def run(self) -> None:
        """Step until cancelled; a failed publish (Redis down) is logged and retried."""
        failing = False
        while True:
            try:
                await self.step()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop's one broad except
                if not failing:
                    log.warning("engine telemetry: %s", exc)
                failing = True
            if cancel_requested():
                # A library under step() turned our cancellation into a return or an
                # error (redis-py, aiohttp): stop anyway, or the controller never steps down.
                raise asyncio.CancelledError
            due = self.next_due()
            wait = 1.0 if due is None else due - self._clock()
            await asyncio.sleep(min(1.0, max(0.05, wait)))

    async def _scrape(self, state: _State) -> None:
        target = state.target
        started = self._clock()
        self.scrapes += 1
        try:
            text = await self._fetch(target)
            sample = parse_metrics(text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure: the replica is unknown, never more
            state.failures += 1
            backoff = min(MAX_BACKOFF, target.interval * 2.0 ** min(state.failures, 10))
            state.due = started + backoff
            state.sample = None
            state.stats = EngineStats(url=target.url, at=started, error=_describe(exc))
            return
        if sample.engine == "llamacpp" and not state.props_read:
            state.props_read = True
            state.capacity, state.slots = await self._llamacpp_props(target)
        if sample.capacity is None:
            sample.capacity = state.capacity
        if sample.slots is None:
            sample.slots = state.slots
        now = self._clock()
        state.failures = 0
        state.due = started + target.interval
        dt = now - state.sampled_at if state.sample is not None else 0.0
        state.stats = summarize(sample, state.sample, dt, url=target.url, at=now)
        state.sample, state.sampled_at = sample, now

    async def _llamacpp_props(self, target: ScrapeTarget) -> tuple[int | None, int | None]:
        """llama-server's KV size in tokens and its slots, from its /props (n_ctx is per
        slot); None for what it does not say."""
        try:
            props = json.loads(await self._fetch(target, "/props"))
            n_ctx = props["default_generation_settings"]["n_ctx"]
            slots = props.get("total_slots", 1)
            if isinstance(n_ctx, int) and isinstance(slots, int) and n_ctx > 0 and slots > 0:
                return n_ctx * slots, slots
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # optional: the capacity stays unknown
            log.debug("%s: no llama.cpp /props: %s", target.url, _describe(exc))
        return None, None

    async def _fetch(self, target: ScrapeTarget, path: str | None = None) -> str:
        session = self._session
        assert session is not None
        url = target.url.rstrip("/") + (target.path if path is None else path)
        budget = min(self._timeout, max(0.2, target.interval))
        async with asyncio.timeout(budget):
            async with session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise ScrapeFailed(f"HTTP {resp.status}")
                chunks, size = [], 0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > self._max_bytes:
                        raise ScrapeFailed(f"metrics page over {self._max_bytes} bytes")
                    chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")


class ScrapeFailed(Exception):
    """A page that is no metrics page (its message says why, as the record shows it)."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ScrapeFailed):
        return str(exc)[:200]
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:200]
