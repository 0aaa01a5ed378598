"""Drop-in mode: the ready set from an unmodified Sky Serve controller.

Speaks the controller's load-balancer sync protocol (its payloads and the
request log: proxy/sources/skyserve_protocol.py).

Better than the original: syncs every `--sync-interval` (5 s, not 20); keeps
the timestamps of a failed sync and resends them; keeps the current set when a
sync fails; when a sync answers an empty set while the proxy had replicas, it
resyncs after 0.5 s and 1 s, while the proxy holds requests (its empty-wait)
instead of answering 503.

Traps handled here:
- Each sync opens a fresh connection: the controller's uvicorn closes idle
  keep-alive connections after 5 s, the same as our interval, so a kept
  connection is often dead when the next sync writes on it.
- Timestamps are sampled every 100 ms from the request counter into a
  RequestLog (see skyserve_protocol.py for the ordering Sky needs), and
  expanding and encoding a batch runs in a thread, not on the event loop.
- With `--workers N` one process syncs (worker 0): the other workers hand it
  their counts and take the ready set from it over a unix socket that the
  supervisor names (`--sync-relay`), so the controller sees one load balancer.

Sky Serve's own entry point, `run_load_balancer`, stays at `proxy.skyserve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import aiohttp
import msgspec
from aiohttp import web

from proxy.config import ProxyConfig
from proxy.readyset import ReadySet
from proxy.sources.skyserve_protocol import (
    SYNC_PATH,
    WINDOW_SECONDS,
    RequestLog,
    Sample,
    encode_sync_body,
    parse_sync_reply,
)
from proxy.stats import Stats
from proxy.stopping import bounded, stop_tasks
from proxy.wire.errors import SnapshotInvalid
from proxy.wire.policies import DEFAULT_POLICY
from proxy.wire.snapshot import ReadyReplica, ReadySnapshot

log = logging.getLogger("sluice.proxy.skyserve")

RELAY_PATH = "/relay"
QUICK_RESYNC = (0.5, 1.0)  # after an empty answer while replicas were ready
SAMPLE_SECONDS = 0.1
RELAY_INTERVAL = 0.25  # how often a worker hands its counts to worker 0
RELAY_STALE = 2.0  # a worker silent this long no longer holds the watermark back


class _RelayRequest(msgspec.Struct, frozen=True):
    worker: int
    until: float  # the worker has reported every request up to this time
    samples: list[tuple[float, int]]


class _RelayReply(msgspec.Struct, frozen=True):
    replicas: dict[str, str | None] | None  # None: worker 0 has not synced yet


_RELAY_REQ_DECODER = msgspec.json.Decoder(_RelayRequest)
_RELAY_REPLY_DECODER = msgspec.json.Decoder(_RelayReply)
_ENCODER = msgspec.json.Encoder()


class _Counter:
    """Turns the proxy's request counter into per-100 ms samples."""

    def __init__(self, stats: Stats) -> None:
        self._stats = stats
        self._counted = stats.requests_total

    def sample(self) -> int:
        total = self._stats.requests_total
        delta = total - self._counted
        self._counted = total
        return delta


def _snapshot(generation: int, ids: dict[str, int], policy: str,
              replicas: dict[str, str | None]) -> ReadySnapshot:
    for url in replicas:
        ids.setdefault(url, len(ids) + 1)
    return ReadySnapshot(
        service="skyserve",
        generation=generation,
        published_at=time.time(),
        policy=policy,
        active_versions=[],
        replicas=tuple(ReadyReplica(id=ids[u], url=u, accelerator=acc)
                       for u, acc in sorted(replicas.items())),
    )


class _SetApplier:
    """Applies a replica map to the ready set when it changed. A map the ready set
    rejects is logged and counted once (the same map again is skipped)."""

    def __init__(self, policy: str, stats: Stats) -> None:
        self._policy = policy
        self._stats = stats
        self._generation = 0
        self._ids: dict[str, int] = {}
        self.current: dict[str, str | None] | None = None

    def apply(self, ready_set: ReadySet, replicas: dict[str, str | None], who: str) -> None:
        if replicas == self.current:
            return
        self.current = replicas
        self._generation += 1
        try:
            ready_set.apply(_snapshot(self._generation, self._ids, self._policy, replicas))
        except SnapshotInvalid as exc:
            self._stats.snapshots_rejected += 1
            log.warning("rejected %s's ready set (%d replicas): %s; keeping %d replicas",
                        who, len(replicas), exc, len(ready_set.replicas))
            return
        log.info("ready set from %s: %d replicas", who, len(replicas))


class SkyServeSource:
    """Syncs with the Sky Serve controller (the only process that does, per load balancer)."""

    def __init__(self, config: ProxyConfig, stats: Stats) -> None:
        assert config.controller_addr is not None
        self._url = config.controller_addr.rstrip("/") + SYNC_PATH
        self._interval = config.sync_interval
        self._timeout = config.sync_timeout
        self._quick_resync = QUICK_RESYNC if config.quick_resync else ()
        self._relay_path = config.sync_relay if config.workers > 1 else None
        self._stats = stats
        self._session: aiohttp.ClientSession | None = None
        self._relay: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ready_set: ReadySet | None = None
        self._applier = _SetApplier(config.policy or DEFAULT_POLICY, stats)
        self._counter = _Counter(stats)
        self.requests = RequestLog()
        self._workers: dict[int, tuple[float, float]] = {}  # index -> (until, heard at)
        self._closing = False  # set by aclose(); the loops check it (see proxy/stopping.py)

    async def start(self, ready_set: ReadySet) -> None:
        self._ready_set = ready_set
        self._counter = _Counter(self._stats)
        # A fresh connection per sync (force_close): see "Traps" above.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True),
            timeout=aiohttp.ClientTimeout(total=self._timeout))
        if self._relay_path is not None:
            await self._start_relay(self._relay_path)
        loop = asyncio.get_running_loop()
        await self.sync_once()  # serve the controller's set from the first request
        self._tasks = [loop.create_task(self._sync_forever()),
                       loop.create_task(self._sample_forever())]

    async def aclose(self) -> None:
        """Stop the loops, the relay and the client session, each step bounded (2 s in
        all), also with a controller that accepts and never answers."""
        self._closing = True
        await stop_tasks(self._tasks, 1.0)
        self._tasks = []
        if self._relay is not None:
            await bounded(self._relay.cleanup(), 0.5, "closing the sync relay")
        if self._session is not None:
            await bounded(self._session.close(), 0.5, "closing the Sky Serve sync session")

    def sample(self, now: float) -> None:
        n = self._counter.sample()
        if n:
            self.requests.add(now, n)

    def _watermark(self, now: float) -> float:
        """Up to when every worker has reported its counts (a silent worker is skipped)."""
        until = now
        for reported, heard in self._workers.values():
            if now - heard < RELAY_STALE:
                until = min(until, reported)
        return until

    async def sync_once(self) -> bool:
        """One sync; True on success. On failure the counts are kept for the next one."""
        assert self._session is not None and self._ready_set is not None
        now = time.time()
        self.sample(now)
        dropped = self.requests.trim(now)
        if dropped:
            self._stats.timestamps_dropped += dropped
            log.warning("dropped %d request timestamps older than %.0f s (controller "
                        "unreachable); %d dropped in all", dropped, WINDOW_SECONDS,
                        self.requests.dropped)
        batch = self.requests.take(self._watermark(now))
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(None, encode_sync_body, batch)
        try:
            async with self._session.post(
                    self._url, data=body,
                    headers={"Content-Type": "application/json"}) as resp:
                resp.raise_for_status()
                replicas = parse_sync_reply(await resp.json(content_type=None))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            self.requests.give_back(batch)
            self._stats.source_connected = 0
            log.warning("sync with the Sky Serve controller failed (%s: %s); "
                        "keeping %d replicas", type(exc).__name__, exc,
                        len(self._ready_set.replicas))
            return False
        self._stats.source_connected = 1
        self._applier.apply(self._ready_set, replicas, "the Sky Serve controller")
        return True

    async def _sync_forever(self) -> None:
        assert self._ready_set is not None
        while not self._closing:
            await asyncio.sleep(self._interval)
            try:
                had = bool(self._ready_set.replicas)
                ok = await self.sync_once()
                if ok and had and not self._ready_set.replicas:
                    # Likely Sky Serve's relabel/active-versions gap: look again soon while
                    # the proxy holds requests, instead of waiting a full interval.
                    for delay in self._quick_resync:
                        await asyncio.sleep(delay)
                        if await self.sync_once() and self._ready_set.replicas:
                            break
            except Exception:
                if self._closing:
                    return  # a cancellation the client turned into an error
                log.exception("sync loop error")

    async def _sample_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(SAMPLE_SECONDS)
            self.sample(time.time())

    # -- the relay: the other workers' counts in, the ready set out ------------------------

    async def _start_relay(self, path: str) -> None:
        app = web.Application()
        app.router.add_post(RELAY_PATH, self._on_relay)
        self._relay = web.AppRunner(app, access_log=None)
        await self._relay.setup()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a worker 0 that died
        await web.UnixSite(self._relay, path).start()

    async def _on_relay(self, request: web.Request) -> web.Response:
        try:
            msg = _RELAY_REQ_DECODER.decode(await request.read())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return web.Response(status=400, text=str(exc))
        self.requests.extend(msg.samples)
        self._workers[msg.worker] = (msg.until, time.time())
        return web.Response(body=_ENCODER.encode(_RelayReply(self._applier.current)),
                            content_type="application/json")


class RelayFollower:
    """Workers 1..N-1 in drop-in mode: counts to worker 0, the ready set from it."""

    def __init__(self, config: ProxyConfig, stats: Stats) -> None:
        assert config.sync_relay is not None
        self._path = config.sync_relay
        self._index = config.worker_index
        self._stats = stats
        self._counter = _Counter(stats)
        self._samples: list[Sample] = []
        self._applier = _SetApplier(config.policy or DEFAULT_POLICY, stats)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready_set: ReadySet | None = None
        self._closing = False

    async def start(self, ready_set: ReadySet) -> None:
        self._ready_set = ready_set
        self._counter = _Counter(self._stats)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self._path),
            timeout=aiohttp.ClientTimeout(total=2.0))
        await self.relay_once()
        self._task = asyncio.get_running_loop().create_task(self._forever())

    async def aclose(self) -> None:
        self._closing = True
        await stop_tasks((self._task,), 1.0)
        self._task = None
        if self._session is not None:
            await bounded(self.relay_once(), 0.5, "relaying the last counts")
            await bounded(self._session.close(), 0.5, "closing the relay session")

    async def relay_once(self) -> bool:
        assert self._session is not None and self._ready_set is not None
        now = time.time()
        n = self._counter.sample()
        if n:
            self._samples.append((now, n))
        horizon = now - WINDOW_SECONDS
        if self._samples and self._samples[0][0] < horizon:
            self._samples = [s for s in self._samples if s[0] >= horizon]
        samples, self._samples = self._samples, []
        body = _ENCODER.encode(_RelayRequest(self._index, now, samples))
        try:
            async with self._session.post("http://relay" + RELAY_PATH, data=body) as resp:
                resp.raise_for_status()
                reply = _RELAY_REPLY_DECODER.decode(await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError,
                msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._samples = samples + self._samples
            self._stats.source_connected = 0
            log.debug("worker %d: relay to worker 0 failed: %s", self._index, exc)
            return False
        self._stats.source_connected = 1
        if reply.replicas is not None:
            self._applier.apply(self._ready_set, reply.replicas, "worker 0")
        return True

    async def _forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(RELAY_INTERVAL)
            try:
                await self.relay_once()
            except Exception:
                if self._closing:
                    return
                log.exception("relay loop error")


def make_skyserve_source(config: ProxyConfig, stats: Stats) -> SkyServeSource | RelayFollower:
    """Worker 0 (or the only worker) syncs with the controller; the others follow it."""
    if config.workers > 1 and config.worker_index > 0 and config.sync_relay:
        return RelayFollower(config, stats)
    return SkyServeSource(config, stats)
