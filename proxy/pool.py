"""Per-replica keep-alive connection pools (ours, not aiohttp's).

One ReplicaPool per replica URL, created when the replica first appears in a
snapshot and closed by the ready set only after the replica has been gone for
the pool grace with nothing in flight. A pool holds idle connections (LIFO, so
the warmest is reused), opens new ones up to its limit, and queues exchanges
beyond that. Taking an idle connection is a list pop: no Task, no Future.
Opening a connection is the rare path and runs as a task owned by the pool.

An idle connection is reused only while it has been idle less than
`idle_timeout` (`--upstream-idle-timeout`, 4 s by default), read on the
sweeper's coarse clock. Model servers close idle keep-alive connections
themselves (uvicorn under vLLM and SGLang, and llama-server, after 5 s): a
request written just as the server closes its connection is lost before any
response byte. Retiring connections first keeps that race off the request
path instead of leaving it to the stale-connection retry.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import TYPE_CHECKING

from proxy.errors import UpstreamConnectError
from proxy.interfaces import ConnectionWaiter, UpstreamLink
from proxy.upstream import UpstreamConnection
from proxy.waiters import WaiterQueue

if TYPE_CHECKING:
    from proxy.replica import Replica


class Clock:
    """The coarse clock the pools read (`now`, in loop time), advanced by the sweeper."""

    __slots__ = ("now",)

    def __init__(self, now: float) -> None:
        self.now = now


class ReplicaPool:
    """The connections to one replica (an interfaces.ConnectionPool); waiters are the
    Exchanges (interfaces.ConnectionWaiter) that asked for one beyond the limit."""

    def __init__(
        self,
        replica: Replica,
        *,
        limit: int,
        connect_timeout: float,
        clock: Clock,
        idle_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.replica = replica
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.clock = clock
        self.idle_timeout = idle_timeout
        self.ssl_context = ssl_context
        self.idle: list[UpstreamLink] = []
        self.total = 0  # open plus opening connections
        self.waiters: WaiterQueue[ConnectionWaiter] = WaiterQueue()  # FIFO, O(1) cancel
        self.closed = False
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def size(self) -> int:
        return self.total

    def acquire(self, ex: ConnectionWaiter) -> UpstreamLink | None:
        """An idle connection now, or None: then `ex.on_connection` / `ex.on_connect_failed`
        is called later."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if self.clock.now - conn.idle_since < self.idle_timeout:
                return conn
            # Idle too long, and so is every connection under it (LIFO): retire them all.
            conn.close()  # connection_lost -> discard() does the accounting
            for old in idle:
                old.close()
            idle.clear()
        if self.total < self.limit:
            self._open(ex)
        else:
            self.waiters.append(ex)
        return None

    def cancel(self, ex: ConnectionWaiter) -> None:
        """`ex` no longer wants a connection (it timed out, the client left, it retried)."""
        self.waiters.discard(ex)

    def release(self, conn: UpstreamLink, reusable: bool) -> None:
        """Take `conn` back, or hand it straight to a waiting exchange. Never called from
        inside a parser callback (upstream.py): a waiter given the connection there would be
        fed whatever llhttp parses next from the same buffer."""
        conn.exchange = None
        if not reusable or self.closed or conn.closed:
            conn.close()  # connection_lost -> discard() does the accounting
            return
        waiters = self.waiters
        while waiters:
            ex = waiters.popleft()
            if ex.wants_connection(self):
                ex.on_connection(conn)
                return
        conn.idle_since = self.clock.now
        self.idle.append(conn)

    def discard(self, conn: UpstreamLink) -> None:
        """A connection closed; free its slot and start one for the next waiter."""
        self.total -= 1
        try:
            self.idle.remove(conn)
        except ValueError:
            pass
        waiters = self.waiters
        while waiters and not self.closed and self.total < self.limit:
            ex = waiters.popleft()
            if ex.wants_connection(self):
                self._open(ex)
                return

    def _open(self, ex: ConnectionWaiter) -> None:
        self.total += 1
        task = asyncio.get_running_loop().create_task(self._connect(ex))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, ex: ConnectionWaiter) -> None:
        replica = self.replica
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: UpstreamConnection(self),
                    replica.host,
                    replica.port,
                    ssl=self.ssl_context if replica.tls else None,
                    server_hostname=replica.host if replica.tls else None,
                ),
                self.connect_timeout,
            )
        except asyncio.CancelledError:
            self.total -= 1
            raise
        except (OSError, asyncio.TimeoutError, ssl.SSLError, ValueError) as exc:
            # ValueError: a host the resolver refuses (IDNA). apply() rejects those, but
            # a slot must never leak whatever connecting raises.
            self.total -= 1
            if ex.wants_connection(self):
                ex.on_connect_failed(UpstreamConnectError(type(exc).__name__))
            return
        if self.closed:
            conn.close()
            return
        if ex.wants_connection(self):
            ex.on_connection(conn)
        else:
            self.release(conn, reusable=True)

    def close(self) -> None:
        """Close idle connections now; busy ones close when their exchange ends."""
        self.closed = True
        for task in self._tasks:
            task.cancel()
        for conn in self.idle:
            conn.close()
        self.idle.clear()
        for ex in self.waiters.take_all():
            if ex.wants_connection(self):
                ex.on_connect_failed(UpstreamConnectError("PoolClosed"))

    async def wait_closed(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
