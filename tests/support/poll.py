"""The one poller: wait for a condition with a bounded poll, never a fixed sleep.

`await until(check, timeout=10.0, what="...")` calls `check` (a plain function, or
one returning an awaitable) until it returns something truthy, and returns that value.
After `timeout` seconds it fails with an AssertionError naming `what` was awaited and
the last value `check` returned. An exception raised by `check` propagates at once
(an assert inside `check` fails the test without waiting for the timeout).

`until_sync(...)` is the same loop for synchronous tests (CLI runs, blocking
processes): same arguments, same failure message, `time.sleep` between polls.

`await retrying(call, on=(SomeError,), timeout=30.0)` is its twin for a call that fails
for a while (a store call across a Redis failover): it awaits `call()` again while it
raises one of `on`, and re-raises the last error after `timeout`.

`await must_finish(step, what, within)`: a step that must end (a teardown); on timeout
it prints every task's stack to stderr and fails the test naming `what`.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

import pytest

T = TypeVar("T")

INTERVAL = 0.02


def _timed_out(timeout: float, what: str, last: Any) -> AssertionError:
    return AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


@overload
async def until(
    check: Callable[[], Awaitable[T]],
    *,
    timeout: float = ...,
    what: str = ...,
    interval: float = ...,
) -> T: ...
@overload
async def until(
    check: Callable[[], T], *, timeout: float = ..., what: str = ..., interval: float = ...
) -> T: ...
async def until(
    check: Callable[[], Any],
    *,
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = INTERVAL,
) -> Any:
    """Poll `check` (sync or async) until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what, result)
        await asyncio.sleep(interval)


def until_sync(
    check: Callable[[], T],
    *,
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = INTERVAL,
) -> T:
    """`until` for synchronous tests: poll `check` until truthy; return that value."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what, result)
        time.sleep(interval)


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    on: tuple[type[BaseException], ...],
    timeout: float = 30.0,
    interval: float = 0.05,
) -> T:
    """Await `call()` until it does not raise one of `on`; return its result."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except on:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(interval)


async def must_finish(step: Awaitable[object], what: str, within: float = 30.0) -> None:
    """Await `step` for at most `within` seconds; on timeout print every task's stack
    and fail the test.

    The stacks are printed before `step` is cancelled, and the cancelled step gets a
    few seconds more, never longer: a step that swallows the cancellation (an
    `await task` under `suppress(CancelledError)`) must not hang the test until
    pytest-timeout kills the loop with every connection still open."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=within)
    if task in done:
        task.result()
        return
    for other in asyncio.all_tasks():
        other.print_stack(file=sys.stderr)
    task.cancel()
    await asyncio.wait({task}, timeout=5.0)
    pytest.fail(f"{what} took more than {within}s (task stacks on stderr)")
