"""What it costs when many waiting requests leave their queues at once.

Requests wait in two queues: the ready set's (held while no replica is ready)
and a pool's (waiting for a connection at the pool limit). They leave by being
served, or, in any order, by timing out or losing their client. N waiters are
queued, then all removed in random order, through the real ReadySet and
ReplicaPool (proxy.waiters.WaiterQueue) next to the linear list/deque
`remove()` they replaced. Prints a table; asserts nothing.

    python bench/waiters.py [--sizes 1000,5000,20000]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/waiters.py` without installing
    sys.path.insert(0, str(REPO))

from proxy.pool import Clock, ReplicaPool  # noqa: E402
from proxy.readyset import ReadySet  # noqa: E402
from proxy.replica import Replica  # noqa: E402
from proxy.wire.snapshot import ReadyReplica  # noqa: E402


class Held:
    """Stands for an Exchange: the ready set queues its bound `wake`, the pool the object."""

    def __init__(self) -> None:
        self.waiting_on: ReplicaPool | None = None

    def wake(self) -> None:
        pass

    def wants_connection(self, pool: ReplicaPool) -> bool:
        return self.waiting_on is pool


def _time_removals(add: Callable[[Held], None], remove: Callable[[Held], None],
                   n: int) -> float:
    held = [Held() for _ in range(n)]
    for h in held:
        add(h)
    order = held[:]
    random.Random(7).shuffle(order)
    start = time.perf_counter()
    for h in order:
        remove(h)
    return time.perf_counter() - start


def _queues_row(n: int) -> str:
    ready_set = ReadySet()
    new_rs = _time_removals(lambda h: ready_set.add_waiter(h.wake),
                            lambda h: ready_set.remove_waiter(h.wake), n)
    old_list: list[Callable[[], None]] = []

    def list_remove(h: Held) -> None:  # ReadySet.remove_waiter before WaiterQueue
        try:
            old_list.remove(h.wake)
        except ValueError:
            pass

    old_rs = _time_removals(lambda h: old_list.append(h.wake), list_remove, n)
    pool = ReplicaPool(Replica(ReadyReplica(id=1, url="http://127.0.0.1:9")), limit=0,
                       connect_timeout=1.0, clock=Clock(0.0), idle_timeout=4.0)

    def pool_add(h: Held) -> None:
        h.waiting_on = pool
        pool.acquire(h)  # type: ignore[arg-type]

    new_pool = _time_removals(pool_add, lambda h: pool.cancel(h), n)  # type: ignore[arg-type]
    old_deque: collections.deque[Held] = collections.deque()  # ReplicaPool before
    old_pool = _time_removals(old_deque.append, old_deque.remove, n)
    return (f"| {n:,} | {new_rs * 1e3:.1f} | {old_rs * 1e3:.1f} | {new_pool * 1e3:.1f} "
            f"| {old_pool * 1e3:.1f} |")


def queues_table(sizes: list[int]) -> None:
    print("| waiters | ready set (WaiterQueue) ms | list.remove ms | pool (WaiterQueue) ms "
          "| deque.remove ms |")
    print("|---:|---:|---:|---:|---:|")
    for n in sizes:
        print(_queues_row(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,5000,20000")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}\n")
    queues_table([int(x) for x in args.sizes.split(",") if x])


if __name__ == "__main__":
    main()
