"""proxy.stopping: stopping background tasks that do not stop at the first cancel."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from proxy.stopping import bounded, stop_tasks


async def swallows_cancels(times: int, stopped: list[bool]) -> None:
    """A loop that, like library code now and then, turns `times` cancellations into
    nothing and carries on."""
    left = times
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if left == 0:
                stopped.append(True)
                raise
            left -= 1


async def test_a_task_that_swallows_a_few_cancels_is_stopped() -> None:
    stopped: list[bool] = []
    task = asyncio.create_task(swallows_cancels(3, stopped))
    await asyncio.sleep(0)
    assert await stop_tasks([task, None], within=5.0) == 0
    assert task.cancelled() and stopped == [True]


async def test_a_task_that_never_stops_is_abandoned_after_the_bound() -> None:
    task = asyncio.create_task(swallows_cancels(10**9, []))
    await asyncio.sleep(0)
    assert await stop_tasks([task], within=0.2) == 1
    assert not task.done()
    task.get_coro().close()  # drop it without awaiting


async def test_bounded_cuts_a_step_short_and_never_raises_its_errors() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    await bounded(fails(), 1.0, "a failing step")
    stopped: list[bool] = []
    await bounded(swallows_cancels(2, stopped), 0.05, "a stuck step")
    assert stopped == [True]


async def test_stop_tasks_does_not_swallow_its_callers_cancellation() -> None:
    stuck = asyncio.create_task(swallows_cancels(10**9, []))
    await asyncio.sleep(0)
    caller = asyncio.create_task(stop_tasks([stuck], within=30.0))
    await asyncio.sleep(0.1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    stuck.get_coro().close()
    with contextlib.suppress(BaseException):
        await asyncio.sleep(0)
