"""The proxy's ready set: the snapshot in force and the replicas derived from it.

Every source of the ready set (a static list, Redis, the Sky Serve sync
protocol) calls `ReadySet.apply(snapshot)`; nothing else in the proxy knows
where snapshots come from. Applying is one reference swap: requests in flight
keep the Replica they picked.

`apply` is also the boundary where a snapshot is checked for what would break
the proxy although it passed wire validation: a URL with a port out of range,
an empty host, a host that is neither an IP address nor an ASCII DNS name with
labels of at most 63 bytes, a scheme other than http/https, a duplicate
replica id or URL. Such a snapshot raises SnapshotInvalid (naming the replica
and the defect) before any state changes: it is rejected whole and the set in
force stays (the URL checks live with the Replica, proxy/replica.py). The source
counts and logs it. A Replica (and its connection pool) outlives its absence
from the set for `pool_grace` seconds, so a replica that flaps out for one
snapshot comes back warm; its pool is closed only after the grace and with
nothing in flight.

Requests wait here for a replica when the set is empty (`add_waiter`); a source
may register a hold listener (`set_hold_listener`) to learn that a request is
being held, e.g. to ask the controller for a replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from proxy.errors import ConfigError
from proxy.interfaces import ConnectionPool, Policy, ReplicaView, Routable
from proxy.placement import PlacementTable
from proxy.policies import make_policy
from proxy.replica import Replica
from proxy.waiters import WaiterQueue
from proxy.wire.errors import SnapshotInvalid
from proxy.wire.policies import DEFAULT_POLICY
from proxy.wire.snapshot import PrefixOptions, ReadySnapshot

log = logging.getLogger("sluice.proxy")

PLACEMENT_STALE = 2.0  # s without a placement refresh before the sweeper does one


class ReadySet:
    """The snapshot in force, its Replicas and policy, and the requests held for a replica."""

    def __init__(
        self,
        *,
        policy_override: str | None = None,
        target_qps: dict[str, float] | None = None,
        prefix_options: PrefixOptions | None = None,
        pool_factory: Callable[[Replica], ConnectionPool] | None = None,
        pool_grace: float = 30.0,
        resume_streams: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy_override = policy_override
        self._target_qps = target_qps
        self._prefix_override = prefix_options
        self._pool_factory = pool_factory
        self._pool_grace = pool_grace
        self._clock = clock
        self._resume_override = resume_streams
        # Resume cut streams (proxy/resume.py): the flag, else the service's snapshot.
        self.resume_streams = bool(resume_streams)
        self.snapshot: ReadySnapshot | None = None
        self.replicas: tuple[Replica, ...] = ()
        self.known: dict[str, Replica] = {}
        self.policy: Policy = make_policy(policy_override or DEFAULT_POLICY, target_qps,
                                          prefix_options)
        # The prefix options the policy was made with (a prefix policy keeps them).
        self._policy_prefix = prefix_options or PrefixOptions()
        self.applied_at = 0.0  # wall clock of the last apply
        # Requests held for a replica (their wake callbacks), FIFO; removal is O(1).
        self._waiters: WaiterQueue[Callable[[], None]] = WaiterQueue()
        self._on_hold: Callable[[], None] | None = None  # set_hold_listener

    def set_hold_listener(self, listener: Callable[[], None] | None) -> None:
        """Have `listener()` called whenever a request starts waiting while the set is empty.

        It runs on the request path, so it must not block or do I/O (the Redis source
        passes an Event's `set` and turns it into a demand nudge for a service scaled to
        zero). One listener at a time; None removes it.
        """
        self._on_hold = listener

    @property
    def generation(self) -> int:
        return -1 if self.snapshot is None else self.snapshot.generation

    def apply(self, snapshot: ReadySnapshot, *, reset: bool = False) -> bool:
        """Install `snapshot` if it is newer than the one in force; True if applied.

        `reset=True` installs it whatever its generation: the source knows the
        generations it follows restarted (Redis lost its data). A snapshot that would
        break the proxy raises SnapshotInvalid and changes nothing (module doc).
        """
        current = self.snapshot
        if current is not None and snapshot.generation <= current.generation and not reset:
            return False
        now = self._clock()
        # Check the whole snapshot and build every new Replica before touching any state:
        # a defect (SnapshotInvalid) leaves the set exactly as it was.
        _check_unique(snapshot)
        fresh = {info.url: Replica(info) for info in snapshot.replicas
                 if info.url not in self.known}
        replicas: list[Replica] = []
        for info in snapshot.replicas:
            replica = fresh.get(info.url)
            if replica is not None:
                if self._pool_factory is not None:
                    replica.pool = self._pool_factory(replica)
                self.known[info.url] = replica
            else:
                replica = self.known[info.url]
                replica.refresh(info)
            replica.left_at = None
            replicas.append(replica)
        in_set = {r.url for r in replicas}
        for url, replica in self.known.items():
            if url not in in_set and replica.left_at is None:
                replica.left_at = now
        policy = self.policy
        wanted = self._policy_override or snapshot.policy
        prefix = self._prefix_override or snapshot.prefix_options or PrefixOptions()
        if wanted != policy.name or (wanted == "prefix" and self._policy_prefix != prefix):
            try:
                policy = make_policy(wanted, self._target_qps, prefix)
                self._policy_prefix = prefix
            except ConfigError:
                log.warning("snapshot %d names unknown policy %r; keeping %s",
                            snapshot.generation, wanted, policy.name)
        policy.update(replicas)
        # One assignment each; a request reading these sees old or new, never a mix
        # that matters (the policy holds its own copy of the list).
        self.policy = policy
        self.replicas = tuple(replicas)
        self.snapshot = snapshot
        override = self._resume_override
        self.resume_streams = snapshot.resume_streams if override is None else override
        self.applied_at = time.time()
        if replicas and self._waiters:
            for wake in self._waiters.take_all():
                wake()
        return True

    def choose(self, exclude: set[ReplicaView] | None = None,
               request: Routable | None = None) -> ReplicaView | None:
        return self.policy.choose(exclude, request)

    def add_waiter(self, wake: Callable[[], None]) -> None:
        self._waiters.append(wake)
        on_hold = self._on_hold
        if on_hold is not None and not self.replicas:
            on_hold()

    def remove_waiter(self, wake: Callable[[], None]) -> None:
        self._waiters.discard(wake)

    def refresh_placement(self, now: float) -> None:
        """The prefix policy's placement table refreshed (its clock, expiries, capacities)
        when nothing did for `PLACEMENT_STALE` seconds: the shared-placement task does it
        each second, but it is absent without Redis and stalled while Redis is down."""
        table = getattr(self.policy, "placement", None)
        if isinstance(table, PlacementTable) and now - table.now >= PLACEMENT_STALE:
            table.refresh(now)

    def sweep(self) -> None:
        """Close the pools of replicas gone longer than the grace with nothing in flight."""
        if len(self.known) == len(self.replicas):
            return
        now = self._clock()
        for url, replica in list(self.known.items()):
            left = replica.left_at
            if left is not None and now - left >= self._pool_grace and replica.inflight == 0:
                del self.known[url]
                if replica.pool is not None:
                    replica.pool.close()
                # The prefix policy's per-replica counters (/metrics series) go with it.
                routed = getattr(self.policy, "routed", None)
                if isinstance(routed, dict):
                    routed.pop(url, None)
                outcomes = getattr(self.policy, "outcomes", None)
                if isinstance(outcomes, dict):
                    outcomes.pop(url, None)

    def close(self) -> None:
        for replica in self.known.values():
            if replica.pool is not None:
                replica.pool.close()
        self.known.clear()
        self.replicas = ()
        self.policy.update(())


def _check_unique(snapshot: ReadySnapshot) -> None:
    ids: set[int] = set()
    urls: set[str] = set()
    for info in snapshot.replicas:
        if info.id in ids:
            raise SnapshotInvalid(f"duplicate replica id {info.id}")
        if info.url in urls:
            raise SnapshotInvalid(f"duplicate replica url {info.url!r}")
        ids.add(info.id)
        urls.add(info.url)
