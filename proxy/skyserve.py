"""Drop-in mode: the ready set from an unmodified Sky Serve controller.

Speaks the controller's load-balancer sync protocol:

    POST {controller_addr}/controller/load_balancer_sync
         {"request_aggregator": {"timestamps": [unix seconds, one per request]}}
    <-   {"replica_info": {"<replica url>": {"gpu_type": "<accelerator or unknown>"}}}

(older controllers answer {"ready_replica_urls": [...]}; both are read).

Better than the original: syncs every `--sync-interval` (5 s, not 20); keeps
the timestamps of a failed sync and resends them; keeps the current set when a
sync fails; when a sync answers an empty set while the proxy had replicas, it
resyncs after 0.5 s and 1 s, while the proxy holds requests (its empty-wait)
instead of answering 503. Timestamps are not taken per request: a sampler
turns the proxy's request counter into per-100 ms counts, expanded into
timestamps at sync time (Sky Serve's autoscaler counts them in 60 s windows).

`run_load_balancer(...)` has the signature the Sky Serve service process calls,
so pointing it at sluice is a one-line import change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import aiohttp

from proxy.config import ProxyConfig
from proxy.errors import SnapshotInvalid
from proxy.readyset import ReadySet
from proxy.snapshot import ReadyReplica, ReadySnapshot
from proxy.stats import Stats
from proxy.tasks import bounded, stop_tasks

log = logging.getLogger("sluice.proxy.skyserve")

SYNC_PATH = "/controller/load_balancer_sync"
QUICK_RESYNC = (0.5, 1.0)  # after an empty answer while replicas were ready
SAMPLE_SECONDS = 0.1


def parse_sync_reply(body: Any) -> dict[str, str | None]:
    """Replica URL -> accelerator (None when unknown), from either reply shape."""
    if not isinstance(body, dict):
        raise ValueError("sync reply is not a JSON object")
    out: dict[str, str | None] = {}
    info = body.get("replica_info")
    if isinstance(info, dict):
        for url, meta in info.items():
            gpu = meta.get("gpu_type") if isinstance(meta, dict) else None
            out[_normalise(url)] = None if gpu in (None, "", "unknown") else str(gpu)
        return out
    urls = body.get("ready_replica_urls")
    if isinstance(urls, list):
        return {_normalise(u): None for u in urls if isinstance(u, str)}
    raise ValueError("sync reply has neither replica_info nor ready_replica_urls")


def _normalise(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


class SkyServeSource:
    def __init__(self, config: ProxyConfig, stats: Stats) -> None:
        assert config.controller_addr is not None
        self._url = config.controller_addr.rstrip("/") + SYNC_PATH
        self._interval = config.sync_interval
        self._timeout = config.sync_timeout
        self._quick_resync = QUICK_RESYNC if config.quick_resync else ()
        self._policy = config.policy or "least_load"
        self._stats = stats
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ready_set: ReadySet | None = None
        self._generation = 0
        self._ids: dict[str, int] = {}
        self._current: dict[str, str | None] | None = None
        self._samples: list[tuple[float, int]] = []  # (time, requests in that 100 ms)
        self._counted = 0
        self._unsent: list[float] = []
        self._closing = False  # set by aclose(); the loops check it (see proxy/tasks.py)

    async def start(self, ready_set: ReadySet) -> None:
        self._ready_set = ready_set
        self._counted = self._stats.requests_total
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout))
        loop = asyncio.get_running_loop()
        await self.sync_once()  # serve the controller's set from the first request
        self._tasks = [loop.create_task(self._sync_forever()),
                       loop.create_task(self._sample_forever())]

    async def aclose(self) -> None:
        """Stop the loops and close the client session, each step bounded (1.5 s in all),
        also with a controller that accepts and never answers."""
        self._closing = True
        await stop_tasks(self._tasks, 1.0)
        self._tasks = []
        if self._session is not None:
            await bounded(self._session.close(), 0.5, "closing the Sky Serve sync session")

    def sample(self, now: float) -> None:
        total = self._stats.requests_total
        delta = total - self._counted
        if delta:
            self._counted = total
            self._samples.append((now, delta))

    def take_timestamps(self) -> list[float]:
        stamps = self._unsent
        for t, n in self._samples:
            step = SAMPLE_SECONDS / n
            stamps.extend(t - SAMPLE_SECONDS + step * (i + 1) for i in range(n))
        self._samples = []
        self._unsent = []
        return stamps

    async def sync_once(self) -> bool:
        """One sync; True on success. On failure the timestamps are kept for the next one."""
        assert self._session is not None and self._ready_set is not None
        self.sample(time.time())
        stamps = self.take_timestamps()
        payload = {"request_aggregator": {"timestamps": stamps}}
        try:
            async with self._session.post(self._url, json=payload) as resp:
                resp.raise_for_status()
                replicas = parse_sync_reply(await resp.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._unsent = stamps + self._unsent
            self._stats.source_connected = 0
            log.warning("sync with the Sky Serve controller failed (%s: %s); "
                        "keeping %d replicas", type(exc).__name__, exc,
                        len(self._ready_set.replicas))
            return False
        self._stats.source_connected = 1
        self._apply(replicas)
        return True

    def _apply(self, replicas: dict[str, str | None]) -> None:
        assert self._ready_set is not None
        if replicas == self._current:
            return
        self._current = replicas
        self._generation += 1
        for url in replicas:
            self._ids.setdefault(url, len(self._ids) + 1)
        snapshot = ReadySnapshot(
            service="skyserve",
            generation=self._generation,
            published_at=time.time(),
            policy=self._policy,
            active_versions=[],
            replicas=tuple(ReadyReplica(id=self._ids[u], url=u, accelerator=acc)
                           for u, acc in sorted(replicas.items())),
        )
        try:
            self._ready_set.apply(snapshot)
        except SnapshotInvalid as exc:
            # Logged and counted once: the same answer again is skipped above.
            self._stats.snapshots_rejected += 1
            log.warning("rejected the Sky Serve controller's ready set (%d replicas): %s; "
                        "keeping %d replicas", len(replicas), exc,
                        len(self._ready_set.replicas))
            return
        log.info("ready set from the Sky Serve controller: %d replicas", len(replicas))

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


class TlsCredential(Protocol):
    keyfile: str
    certfile: str


def run_load_balancer(
    controller_addr: str,
    load_balancer_port: int,
    load_balancing_policy_name: str | None = None,
    tls_credential: TlsCredential | None = None,
    target_qps_per_replica: float | dict[str, float] | None = None,
    stream_timeout_seconds: int | None = 120,
) -> None:
    """Sky Serve's load-balancer entry point, served by sluice-proxy (blocks until SIGTERM)."""
    from proxy.cli import run_proxy

    target_qps: dict[str, float] = {}
    if isinstance(target_qps_per_replica, dict):
        target_qps = {str(k): float(v) for k, v in target_qps_per_replica.items()}
    config = ProxyConfig(
        port=load_balancer_port,
        controller_addr=controller_addr,
        policy=load_balancing_policy_name,
        target_qps=target_qps,
        stream_idle_timeout=float(stream_timeout_seconds or 120),
        tls_certfile=tls_credential.certfile if tls_credential else None,
        tls_keyfile=tls_credential.keyfile if tls_credential else None,
        admin_port=None,
    )
    run_proxy(config)
