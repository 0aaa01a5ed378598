"""Waiter queues (proxy/waiters.py) and their two users, the ready set (requests held for a
replica) and the connection pool (requests waiting for a connection): FIFO order, removal
of any waiter, and removal cost that does not grow with the queue.

The cost is checked without a clock: the waiters count how often they are compared, which
is what a linear `list.remove` / `deque.remove` does once per queued waiter. Timings are in
bench/waiters.py.
"""

from __future__ import annotations

import random

import pytest

from proxy.pool import Clock, ReplicaPool
from proxy.readyset import ReadySet
from proxy.replica import Replica
from proxy.upstream import UpstreamConnection
from proxy.waiters import WaiterQueue
from proxy.wire.snapshot import ReadyReplica
from tests.support.builders import snapshot


class Waiter:
    """A waiter that records when it is woken or handed a connection, and counts every
    equality comparison made on it (a linear scan compares each queued waiter)."""

    compared = 0

    def __init__(self, name: int, log: list[int]) -> None:
        self.name = name
        self.log = log
        self.waiting_on: ReplicaPool | None = None

    def __eq__(self, other: object) -> bool:
        Waiter.compared += 1
        return self is other

    def __hash__(self) -> int:
        return id(self)

    # the ready set calls its waiters
    def __call__(self) -> None:
        self.log.append(self.name)

    # the pool asks its waiters these (the Exchange interface)
    def wants_connection(self, pool: ReplicaPool) -> bool:
        return self.waiting_on is pool

    def on_connection(self, conn: UpstreamConnection) -> None:
        self.waiting_on = None
        self.log.append(self.name)


def test_queue_is_fifo_with_removal_anywhere() -> None:
    q: WaiterQueue[str] = WaiterQueue()
    for w in "abcde":
        q.append(w)
    q.discard("c")
    q.discard("zzz")  # not queued: nothing
    q.append("a")  # already queued: keeps its place
    assert len(q) == 4 and "c" not in q and "b" in q
    assert q.popleft() == "a"
    q.append("c")
    assert list(q) == ["b", "d", "e", "c"]
    assert q.take_all() == ["b", "d", "e", "c"]
    assert not q and len(q) == 0
    with pytest.raises(KeyError):
        q.popleft()


def test_ready_set_wakes_held_requests_in_arrival_order_minus_the_removed() -> None:
    ready_set = ReadySet()
    woken: list[int] = []
    waiters = [Waiter(i, woken) for i in range(6)]
    for w in waiters:
        ready_set.add_waiter(w)
    ready_set.remove_waiter(waiters[3])
    ready_set.remove_waiter(waiters[0])
    ready_set.apply(snapshot(1))  # still empty: nobody woken
    assert woken == []
    ready_set.apply(snapshot(2, "http://127.0.0.1:9"))
    assert woken == [1, 2, 4, 5]
    ready_set.apply(snapshot(3, "http://127.0.0.1:10"))
    assert woken == [1, 2, 4, 5]  # woken once only


def _full_pool() -> ReplicaPool:
    replica = Replica(ReadyReplica(id=1, url="http://127.0.0.1:9"))
    pool = ReplicaPool(replica, limit=0, connect_timeout=1.0, clock=Clock(0.0),
                       idle_timeout=4.0)  # every acquire waits
    return pool


def test_pool_hands_released_connections_to_waiters_in_order_skipping_cancelled() -> None:
    pool = _full_pool()
    served: list[int] = []
    waiters = [Waiter(i, served) for i in range(5)]
    for w in waiters:
        w.waiting_on = pool
        assert pool.acquire(w) is None  # type: ignore[arg-type]
    pool.cancel(waiters[1])  # type: ignore[arg-type]
    waiters[2].waiting_on = None  # gave up without telling the pool (timed out, retried)
    for _ in range(3):
        pool.release(UpstreamConnection(pool), reusable=True)
    assert served == [0, 3, 4]
    assert not pool.waiters


@pytest.mark.parametrize("where", ["ready set", "pool"])
def test_removing_many_waiters_costs_no_scan(where: str) -> None:
    n = 4000
    pool = _full_pool()
    ready_set = ReadySet()
    log: list[int] = []
    waiters = [Waiter(i, log) for i in range(n)]
    for w in waiters:
        if where == "pool":
            w.waiting_on = pool
            pool.acquire(w)  # type: ignore[arg-type]
        else:
            ready_set.add_waiter(w)
    order = waiters[:]
    random.Random(11).shuffle(order)  # timeouts and departures come in any order
    Waiter.compared = 0
    for w in order:
        if where == "pool":
            pool.cancel(w)  # type: ignore[arg-type]
        else:
            ready_set.remove_waiter(w)
    # A linear remove compares ~n/2 waiters per removal (~4,000,000 here); a hash lookup
    # compares at most a colliding one or two.
    assert Waiter.compared <= 2 * n, Waiter.compared
    assert not pool.waiters
