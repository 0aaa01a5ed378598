"""controlplane.lease against a real redis-server: the leader's loop (`lead`), waiting
for the lease (`acquire`), and the holder ids.

`run` stands in for `Controller.run` (a coroutine that runs until cancelled). The store
is the real `Store`, with `Recording` noting each renewal's outcome (no fake Redis); a
stalled Redis is a real redis-server stopped with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from controlplane import lease
from controlplane.errors import LeaseLost
from controlplane.redisserver import EmbeddedRedis
from controlplane.store import Store
from tests.support.poll import until


class Recording(Store):
    """The real store, whose leases note the outcome of every renewal in `renewals`
    (True, False, or "cancelled" when the renewal was cancelled before Redis answered)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.renewals: list[bool | str] = []
        self.renewing = asyncio.Event()

    def lease(self, holder: str, ttl: float) -> lease.Lease:
        return NotedLease(self, super().lease(holder, ttl))


class NotedLease(lease.Lease):
    """A real lease whose `extend` is noted in its store's `renewals`."""

    def __init__(self, store: Recording, base: lease.Lease) -> None:
        super().__init__(base.redis, base.key, base.holder, base.ttl)
        self.store = store

    async def extend(self) -> bool:
        self.store.renewing.set()
        try:
            renewed = await super().extend()
        except asyncio.CancelledError:
            self.store.renewals.append("cancelled")
            raise
        self.store.renewals.append(renewed)
        return renewed


class Run:
    """A stand-in for `Controller.run`: runs until cancelled. `stop_slowly`: once
    cancelled, it waits for `release` before it ends (a controller closing down)."""

    def __init__(self, *, stop_slowly: bool = False) -> None:
        self.started = asyncio.Event()
        self.stopping = asyncio.Event()
        self.release = asyncio.Event()
        self.finished = asyncio.Event()
        self.cancelled = False
        self._stop_slowly = stop_slowly

    async def __call__(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            self.stopping.set()
            if self._stop_slowly:
                await self.release.wait()
            raise
        finally:
            self.finished.set()


class SwallowingRun:
    """A stand-in for a `Controller.run` under which a library turned the first cancel
    into a normal return (redis-py does now and then): it goes on until cancelled again."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.swallowed = 0

    async def __call__(self) -> None:
        self.started.set()
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if self.swallowed:
                    raise
                self.swallowed += 1  # swallowed: the loop goes on


@pytest.fixture
async def recording(redis_url: str, redis_prefix: str) -> AsyncIterator[Recording]:
    async with Recording.from_url(redis_url, prefix=redis_prefix) as store:
        yield store


async def _leading(store: Store, ttl: float, run: Run) -> asyncio.Task[None]:
    """`lead` started as a task for holder "a", once "a" holds the lease and run() runs."""
    assert await store.lease("a", ttl).acquire()
    task = asyncio.create_task(lease.lead(store.lease("a", ttl), run))
    await asyncio.wait_for(run.started.wait(), 10)
    return task


async def test_lead_returns_at_the_first_renewal_that_finds_the_lease_stolen(
    recording: Recording, redis_client: aioredis.Redis
) -> None:
    run = Run()
    task = await _leading(recording, 1.5, run)
    await until(lambda: True in recording.renewals, timeout=10, what="a renewal")
    before = len(recording.renewals)
    await redis_client.set(recording.keys.leader, "b")  # a successor took it over
    await asyncio.wait_for(task, 10)
    # Stepped down at the first refusal (one in flight during the SET may have renewed).
    assert recording.renewals[before:].count(False) == 1
    assert recording.renewals[-1] is False
    assert run.cancelled
    assert await recording.lease_holder() == "b"  # the successor's lease is untouched


async def test_lead_steps_down_even_when_the_run_swallows_a_cancel(
    recording: Recording, redis_client: aioredis.Redis
) -> None:
    # Before: lead cancelled its run once and waited for it for ever; the resumed leader
    # of test_fencing then never stepped down (its engine scraper had swallowed it).
    run = SwallowingRun()
    assert await recording.lease("a", 1.5).acquire()
    task = asyncio.create_task(lease.lead(recording.lease("a", 1.5), run))
    await asyncio.wait_for(run.started.wait(), 10)
    await redis_client.set(recording.keys.leader, "b")  # a successor took it over
    done, _ = await asyncio.wait({task}, timeout=lease.STOP_SLOW + 15)
    assert task in done, "lead still waits for a run that swallowed its cancel"
    task.result()  # returned: stepped down
    assert run.swallowed == 1


async def test_a_run_refused_by_the_fence_ends_the_lead(recording: Recording) -> None:
    async def refused() -> None:
        raise LeaseLost("commit refused: the leader lease is b's")

    assert await recording.lease("a", 30).acquire()
    await asyncio.wait_for(lease.lead(recording.lease("a", 30), refused), 10)  # returns, no raise
    assert recording.renewals == []


async def test_a_run_failing_otherwise_propagates_from_lead(recording: Recording) -> None:
    async def broken() -> None:
        raise RuntimeError("bug")

    assert await recording.lease("a", 30).acquire()
    with pytest.raises(RuntimeError, match="bug"):
        await asyncio.wait_for(lease.lead(recording.lease("a", 30), broken), 10)


async def test_cancelling_lead_cancels_the_run_and_propagates(recording: Recording) -> None:
    run = Run()
    task = await _leading(recording, 30, run)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert run.cancelled
    assert await recording.lease_holder() == "a"  # releasing is the caller's business


async def test_a_cancellation_while_the_run_stops_still_propagates(
    recording: Recording, redis_client: aioredis.Redis
) -> None:
    """The lease is lost, and while the run is still closing down, lead itself is
    cancelled (SIGTERM): the cancellation must not turn into "lost the lease"."""
    run = Run(stop_slowly=True)
    task = await _leading(recording, 1.5, run)
    await redis_client.set(recording.keys.leader, "b")
    await asyncio.wait_for(run.stopping.wait(), 10)  # lead is waiting for the run to end
    task.cancel()
    run.release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    await asyncio.wait_for(run.finished.wait(), 10)


async def test_lead_steps_down_when_redis_stalls(
    redis_factory: Callable[..., EmbeddedRedis], redis_prefix: str
) -> None:
    """Renewals that get no answer: the leader steps down (0.6 TTL after the last
    renewal) instead of acting on a lease that may have expired."""
    server = redis_factory()
    pid = server.pid
    assert pid is not None
    async with Recording.from_url(server.url, prefix=redis_prefix) as store:
        run = Run()
        task = await _leading(store, 1.5, run)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.wait_for(task, 20)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert run.cancelled


async def test_a_refused_commit_ends_the_lead_without_waiting_for_the_renewal(
    redis_factory: Callable[..., EmbeddedRedis],
    redis_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While a renewal waits for a stalled Redis, the run raises LeaseLost: lead returns
    at once, cancelling the renewal (it does not wait for the renewal to time out)."""
    server = redis_factory()
    pid = server.pid
    assert pid is not None
    ttl = 6.0  # the renewal waits up to 2 s for an answer: far longer than lead needs

    async with Recording.from_url(server.url, prefix=redis_prefix) as store:

        async def refused_during_renewal() -> None:
            await store.renewing.wait()
            raise LeaseLost("commit refused")

        assert await store.lease("a", ttl).acquire()
        os.kill(pid, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="sluice.controller"):
                leading = lease.lead(store.lease("a", ttl), refused_during_renewal)
                await asyncio.wait_for(leading, 20)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert store.renewals == ["cancelled"]
    assert "renewing the lease" not in caplog.text  # the renewal never timed out


async def test_acquire_waits_until_the_lease_is_free(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    assert await store.lease("b", 30).acquire()
    with caplog.at_level(logging.INFO, logger="sluice.controller"):
        waiting = asyncio.create_task(lease.acquire(store.lease("a", 0.3)))
        await until(lambda: "standing by (the lease is b's)" in caplog.text, timeout=10)
        assert not waiting.done()
        assert await store.lease("b", 30).release()
        await asyncio.wait_for(waiting, 10)
    assert await store.lease_holder() == "a"


def test_holder_ids_are_unique_per_process_and_call() -> None:
    assert lease.unique_holder("ctl").startswith("ctl:")
    assert lease.unique_holder("ctl") != lease.unique_holder("ctl")
    host, pid, token = lease.default_holder().rsplit(":", 2)
    assert host and int(pid) == os.getpid() and len(token) == 8
    assert lease.unique_holder(None).split(":")[-2] == str(os.getpid())
