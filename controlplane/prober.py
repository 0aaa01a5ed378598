"""Readiness: probing replicas (what a result does is `controlplane.lifecycle`'s).

`Prober` owns one aiohttp ClientSession and the probe tasks. The controller
calls `poll()` on every step: it starts a probe for each replica that is due
(no probe in flight and `endpoint_probe_interval_seconds` since the last one
started) and returns, without waiting, the results that arrived since the last
call. Every probe has its own timeout (`timeout_seconds`); probes of one step
run concurrently; a slow replica never holds up a step, and so never holds up a
commit. A finished probe calls `on_result`, which wakes the controller.

A probe is a GET of the readiness path (a POST of `post_data` when set) with
the probe's headers; READY iff the answer is HTTP 200. Redirects are followed,
as Sky Serve's `requests` call does (a 301/302/303 answer to a POST is followed
with a GET, as there), fewer than `MAX_REDIRECTS` in a row, all within the probe's
one timeout.

What a result does to a replica's state is `controlplane.lifecycle.apply_probe`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from controlplane.records import ReplicaRecord
from controlplane.servicespec import ReadinessProbe
from controlplane.states import PROBED

log = logging.getLogger("sluice.prober")

#: Redirects a probe follows (requests, which Sky Serve's prober uses, allows 30; a
#: readiness path needs one or two).
MAX_REDIRECTS = 10


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome of one probe of one replica."""

    replica_id: int
    ok: bool
    detail: str  # "200", "503", "timeout after 5s", "connect: ..."
    url: str  # the URL probed (a result for a replica that moved is dropped)


class Prober:
    """Probes replicas concurrently; see the module docstring."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        on_result: Callable[[], None] | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        self._clock = clock
        self._on_result = on_result
        self._connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None
        # (service, replica id) -> its probe in flight, when it started, finished results
        self._inflight: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._last_start: dict[tuple[str, int], float] = {}
        self._results: dict[str, dict[int, ProbeResult]] = {}
        self._cancelled: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Open the session."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0),
                # Every request sets its own timeout; no session-wide default.
                timeout=aiohttp.ClientTimeout(total=None),
            )

    async def aclose(self) -> None:
        """Cancel probes in flight and close the session."""
        tasks = [*self._inflight.values(), *self._cancelled]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._inflight.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def poll(
        self,
        service: str,
        replicas: Iterable[tuple[ReplicaRecord, ReadinessProbe]],
        now: float,
    ) -> dict[int, ProbeResult]:
        """Start the probes that are due among `replicas`; return the results that
        finished since the last call for `service` (the latest one per replica).

        Replicas of the service not listed are forgotten (their probes cancelled).
        """
        wanted: set[int] = set()
        for replica, probe in replicas:
            if replica.url is None or replica.status not in PROBED:
                continue
            wanted.add(replica.id)
            key = (service, replica.id)
            if key in self._inflight:
                continue
            last = self._last_start.get(key)
            if last is not None and now - last < probe.endpoint_probe_interval_seconds:
                continue
            self._last_start[key] = now
            self._inflight[key] = asyncio.create_task(
                self._probe(service, replica.id, replica.url, probe),
                name=f"probe {service}/{replica.id}",
            )
        self._forget(service, keep=wanted)
        results = self._results.pop(service, {})
        return {rid: result for rid, result in results.items() if rid in wanted}

    def forget_service(self, service: str) -> None:
        """Drop everything about a service that no longer exists."""
        self._forget(service, keep=set())
        self._results.pop(service, None)

    def next_due(self, service: str, replica_id: int, interval: float) -> float | None:
        """When the replica's next probe is due (None: due now, or one is in flight)."""
        key = (service, replica_id)
        last = self._last_start.get(key)
        if last is None or key in self._inflight:
            return None
        return last + interval

    def _forget(self, service: str, keep: set[int]) -> None:
        for key in [k for k in self._last_start if k[0] == service and k[1] not in keep]:
            del self._last_start[key]
        for key in [k for k in self._inflight if k[0] == service and k[1] not in keep]:
            task = self._inflight.pop(key)
            task.cancel()
            # Kept until it has unwound, so aclose() can await it.
            self._cancelled.add(task)
            task.add_done_callback(self._cancelled.discard)

    async def _probe(self, service: str, replica_id: int, url: str, probe: ReadinessProbe) -> None:
        try:
            ok, detail = await self._request(url, probe)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not kill the prober
            log.exception("probe of %s/%d failed unexpectedly", service, replica_id)
            ok, detail = False, f"error: {exc}"
        finally:
            key = (service, replica_id)
            if self._inflight.get(key) is asyncio.current_task():
                del self._inflight[key]
        self._results.setdefault(service, {})[replica_id] = ProbeResult(replica_id, ok, detail, url)
        if self._on_result is not None:
            self._on_result()

    async def _request(self, url: str, probe: ReadinessProbe) -> tuple[bool, str]:
        if self._session is None:
            raise RuntimeError("Prober.start() was not called")
        body = probe.post_body
        headers = dict(probe.headers)
        if body is not None:
            headers.setdefault("Content-Type", "application/json")
        timeout = aiohttp.ClientTimeout(
            total=probe.timeout_seconds, connect=min(self._connect_timeout, probe.timeout_seconds)
        )
        try:
            async with self._session.request(
                "POST" if body is not None else "GET",
                url.rstrip("/") + probe.path,
                data=body,
                headers=headers,
                timeout=timeout,
                max_redirects=MAX_REDIRECTS,
            ) as resp:
                return resp.status == 200, str(resp.status)
        except TimeoutError:
            return False, f"timeout after {probe.timeout_seconds:g}s"
        except aiohttp.ClientError as exc:
            return False, f"{type(exc).__name__}: {exc}"
