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
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

W = TypeVar("W", bound=Hashable)


class WaiterQueue(Generic[W]):
    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: OrderedDict[W, None] = OrderedDict()

    def append(self, waiter: W) -> None:
        """Queue `waiter` at the end; one already queued keeps its place."""
        self._items[waiter] = None

    def discard(self, waiter: W) -> None:
        """Remove `waiter` wherever it is; nothing if it is not queued."""
        self._items.pop(waiter, None)

    def popleft(self) -> W:
        """The oldest waiter, removed (KeyError when empty)."""
        return self._items.popitem(last=False)[0]

    def take_all(self) -> list[W]:
        """Every waiter, oldest first; the queue is empty afterwards."""
        items = list(self._items)
        self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, waiter: object) -> bool:
        return waiter in self._items

    def __iter__(self) -> Iterator[W]:
        return iter(self._items)
