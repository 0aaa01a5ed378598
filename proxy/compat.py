"""Python 3.10 support for the proxy package: the few names that differ from 3.11.

The drop-in load balancer runs inside Sky Serve's controller runtime, a Python
3.10 environment, so everything under proxy/ must run on 3.10 (controlplane/
needs 3.11). What differs:

- `asyncio.timeout` is 3.11+; on 3.10 it is `async_timeout.timeout` (a
  dependency of aiohttp on 3.10), same semantics.
- On 3.10 `asyncio.TimeoutError` is not the builtin `TimeoutError`: catch
  `asyncio.TimeoutError` (an alias of the builtin on 3.11+), never the builtin.
- `asyncio.Runner` is 3.11+: `run(coro, loop_factory)` below does what the
  proxy needs of it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

if sys.version_info >= (3, 11):
    from asyncio import timeout as timeout
else:  # pragma: no cover - exercised by the 3.10 drop-in test
    from async_timeout import timeout as timeout

__all__ = ["run", "timeout"]


def run(main: Coroutine[Any, Any, None],
        loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """Run `main` on a new loop from `loop_factory`, then cancel leftovers and close it."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main)
        return
    loop = loop_factory()  # pragma: no cover - 3.10
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
