"""A `--workers` worker ends with its supervisor, however the supervisor ends.

A supervisor killed with SIGKILL cannot signal its workers; orphans would keep
serving on the shared SO_REUSEPORT port, and a supervisor started again with other
options would split traffic between old and new workers. Two layers:

- Linux: prctl(PR_SET_PDEATHSIG, SIGTERM), so the kernel sends the worker SIGTERM
  (its normal graceful drain) the moment the parent dies;
- everywhere: `watch_parent` polls getppid() and calls `stop` when the parent it
  started under is gone (reparented), which also covers a parent that died before
  the prctl took effect.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
from collections.abc import Callable

log = logging.getLogger("sluice.proxy")

_PR_SET_PDEATHSIG = 1
WATCH_SECONDS = 0.5


def die_with_parent() -> bool:
    """Ask the kernel for SIGTERM when the parent dies (Linux); True when set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


async def watch_parent(parent: int, stop: Callable[[], None]) -> None:
    """Call `stop` once this process's parent is no longer `parent`."""
    while os.getppid() == parent:  # noqa: ASYNC110 (no event to wait on: a poll of getppid)
        await asyncio.sleep(WATCH_SECONDS)
    log.error("the --workers supervisor (pid %d) is gone; stopping this worker", parent)
    stop()
