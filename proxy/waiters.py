"""WaiterQueue: the FIFO of requests waiting for something (a ready replica, a pooled
connection), with O(1) removal of any waiter.

A held request leaves its queue when it is served, when it times out, or when
its client goes away; the last two happen in any order. With a list or deque,
`remove()` is a linear scan, so N waiters timing out together cost O(N^2):
20,000 held requests stalled the event loop for seconds. Here every operation
is O(1): an OrderedDict keyed by the waiter (its insertion order is the FIFO).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import TypeVar

W = TypeVar("W", bound=Hashable)


class WaiterQueue(OrderedDict[W, None]):
    """An OrderedDict of waiters (values unused): len(), `in`, iteration and truth are the
    dict's own (C, no Python call: `while pool.waiters` runs on every response)."""

    __slots__ = ()

    def append(self, waiter: W) -> None:
        """Queue `waiter` at the end; one already queued keeps its place."""
        self[waiter] = None

    def discard(self, waiter: W) -> None:
        """Remove `waiter` wherever it is; nothing if it is not queued."""
        self.pop(waiter, None)

    def popleft(self) -> W:
        """The oldest waiter, removed (KeyError when empty)."""
        return self.popitem(last=False)[0]

    def take_all(self) -> list[W]:
        """Every waiter, oldest first; the queue is empty afterwards."""
        items = list(self)
        self.clear()
        return items
