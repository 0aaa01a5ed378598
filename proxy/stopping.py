"""Stopping background tasks for sure, within a bound (the proxy's, and the controller's
run loop and its helpers).

Cancelling a task once does not always stop it. A library may turn the
CancelledError into a normal return or an ordinary exception: redis-py (8.1,
Python 3.11) now and then does when the cancel lands while a command reads its
reply, and a loop whose broad `except Exception` then carries on never ends, so
an owner that awaits it hangs (that hung the proxy's shutdown). So every owner
of a loop sets a closing flag the loop checks, and stops its tasks with
`stop_tasks`, which cancels again until they end or the bound passes, and never
swallows its caller's own cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

log = logging.getLogger("sluice.proxy")

RECANCEL = 0.05  # seconds between repeated cancels of a task that is still running


def cancel_requested() -> bool:
    """Whether the running task was asked to stop and has not acted on it: a loop that
    checks this after each await it does not own ends even when a library swallowed the
    CancelledError (Python 3.11+; always False before)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling is not None and cancelling())


async def stop_tasks(tasks: Iterable[asyncio.Task[Any] | None], within: float,
                     logger: logging.Logger = log) -> int:
    """Cancel `tasks` (again every RECANCEL s) until all have ended or `within` seconds
    passed; returns how many are still running (abandoned, and logged to `logger`). A task
    that ended with an exception other than CancelledError is logged too."""
    owned = [t for t in tasks if t is not None]
    pending = {t for t in owned if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while pending:
        for task in pending:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL, remaining))
    for task in owned:
        if task.done() and not task.cancelled() and task.exception() is not None:
            logger.error("background task %s failed", task.get_name(),
                         exc_info=task.exception())
    for task in pending:
        logger.error("background task %s still running %.1fs after it was cancelled; abandoned",
                  task.get_name(), within)
    return len(pending)


async def bounded(aw: Awaitable[Any], within: float, what: str) -> None:
    """Await `aw` for at most `within` seconds (then stop it as `stop_tasks` does and log
    `what`); its exceptions are logged, not raised: this is for cleanup steps."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=within)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s failed: %s", what, task.exception())
        return
    log.warning("%s took longer than %.1fs; cut short", what, within)
    await stop_tasks([task], RECANCEL * 4)
