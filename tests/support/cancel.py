"""A scripted step for the loops that must stop when cancelled, whatever their libraries do.

redis-py turns a cancellation that lands in a command into a ConnectionError now and
then, and aiohttp into a return: a loop that takes it for a failed (or finished) step
and goes on never ends, and whoever cancelled it once waits for ever (a controller's
teardown hung CI for 120 s). `SwallowsCancel(error)` replaces a loop's step: its first
call waits until cancelled and raises `error` instead (None: returns); every later call
waits for ever, so a loop that went on is caught rather than spun. `entered` is set by
the first call; `calls` counts them. `await step.stops(task)`: cancel `task` once, at its
first step, and whether it ended cancelled within 10 s.
"""

from __future__ import annotations

import asyncio


class SwallowsCancel:
    def __init__(self, error: BaseException | None = None) -> None:
        self.entered = asyncio.Event()
        self.calls = 0
        self._error = error

    async def __call__(self) -> None:
        self.calls += 1
        self.entered.set()
        if self.calls > 1:  # later steps swallow nothing (so a loop that goes on still stops)
            await asyncio.Event().wait()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self._error is not None:
                raise self._error from None

    async def stops(self, task: asyncio.Task[None], within: float = 10.0) -> bool:
        await asyncio.wait_for(self.entered.wait(), within)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=within)
        return task in done and task.cancelled()
