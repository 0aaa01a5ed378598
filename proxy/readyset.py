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
force stays. The source counts and logs it. A Replica (and its connection pool) outlives its
absence from the set for `pool_grace` seconds, so a replica that flaps out for
one snapshot comes back warm; its pool is closed only after the grace and with
nothing in flight.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol
from urllib.parse import quote, urlsplit

from proxy.errors import ConfigError
from proxy.policies import Policy, make_policy
from proxy.waiters import WaiterQueue
from proxy.wire.errors import SnapshotInvalid
from proxy.wire.snapshot import PrefixOptions, ReadyReplica, ReadySnapshot

if TYPE_CHECKING:
    from proxy.prefix import Routable

log = logging.getLogger("sluice.proxy")


_DNS_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")


def _check_host(host: str) -> None:
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not host.isascii():
        raise SnapshotInvalid(f"host {host!r} is not ASCII (use its punycode form)")
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253:
        raise SnapshotInvalid(f"host {host[:40]!r}... is longer than 253 bytes")
    for label in name.split("."):
        if not _DNS_LABEL.match(label):
            shown = label if len(label) <= 70 else label[:60] + "..."
            raise SnapshotInvalid(
                f"host {host[:80]!r}: label {shown!r} is not 1-63 letters, digits, "
                f"'-' or '_' ({len(label)} bytes)")


def parse_replica_url(url: str) -> tuple[bool, str, int]:
    """(tls, host, port) of a replica URL; SnapshotInvalid says what is wrong with it."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise SnapshotInvalid(f"url {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise SnapshotInvalid(f"url {url!r}: scheme must be http or https")
    host = parts.hostname
    if not host:
        raise SnapshotInvalid(f"url {url!r} has no host")
    if port == 0:
        raise SnapshotInvalid(f"url {url!r}: port 0")
    try:
        _check_host(host)
    except SnapshotInvalid as exc:
        raise SnapshotInvalid(f"url {url[:120]!r}: {exc}") from None
    tls = parts.scheme == "https"
    return tls, host, port or (443 if tls else 80)


class Pool(Protocol):
    """What the ready set needs of a replica's connection pool."""

    def close(self) -> None: ...

    @property
    def size(self) -> int: ...


class Replica:
    """One upstream replica as the proxy sees it; identity is its URL."""

    __slots__ = (
        "accelerator",
        "host",
        "host_header",
        "id",
        "inflight",
        "left_at",
        "path",
        "pool",
        "port",
        "target_qps",
        "tls",
        "url",
        "version",
    )

    def __init__(self, info: ReadyReplica) -> None:
        try:
            self.tls, self.host, self.port = parse_replica_url(info.url)
        except SnapshotInvalid as exc:
            raise SnapshotInvalid(f"replica {info.id}: {exc}") from None
        self.url = info.url
        default_port = 443 if self.tls else 80
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        if self.port != default_port:
            netloc = f"{netloc}:{self.port}"
        self.host_header = netloc.encode("ascii")
        # A path in the URL (Sky Serve's Kubernetes ingress: http://host/skypilot/ns/c/port)
        # prefixes every request path sent to this replica.
        path = urlsplit(info.url).path.rstrip("/")
        self.path = quote(path, safe="/%:@!$&'()*+,;=-._~").encode("ascii")
        self.id = info.id
        self.version = info.version
        self.accelerator = info.accelerator
        self.target_qps = info.target_qps
        self.inflight = 0
        self.left_at: float | None = None
        self.pool: Pool | None = None

    def refresh(self, info: ReadyReplica) -> None:
        self.id = info.id
        self.version = info.version
        self.accelerator = info.accelerator
        self.target_qps = info.target_qps

    def __repr__(self) -> str:
        return f"Replica({self.id}, {self.url}, inflight={self.inflight})"


class ReadySet:
    def __init__(
        self,
        *,
        policy_override: str | None = None,
        target_qps: dict[str, float] | None = None,
        prefix_options: PrefixOptions | None = None,
        pool_factory: Callable[[Replica], Pool] | None = None,
        pool_grace: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy_override = policy_override
        self._target_qps = target_qps
        self._prefix_override = prefix_options
        self._pool_factory = pool_factory
        self._pool_grace = pool_grace
        self._clock = clock
        self.snapshot: ReadySnapshot | None = None
        self.replicas: tuple[Replica, ...] = ()
        self.known: dict[str, Replica] = {}
        self.policy: Policy = make_policy(policy_override or "least_load", target_qps,
                                          prefix_options)
        self.applied_at = 0.0  # wall clock of the last apply
        # Requests held for a replica (their wake callbacks), FIFO; removal is O(1).
        self._waiters: WaiterQueue[Callable[[], None]] = WaiterQueue()
        # Called (no I/O: it sets an event) when a request starts waiting for a replica;
        # the Redis source turns it into a demand nudge for a service scaled to zero.
        self.on_hold: Callable[[], None] | None = None

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
        if wanted != policy.name or (
                wanted == "prefix" and getattr(policy, "options", None) != prefix):
            try:
                policy = make_policy(wanted, self._target_qps, prefix)
            except ConfigError:
                log.warning("snapshot %d names unknown policy %r; keeping %s",
                            snapshot.generation, wanted, policy.name)
        policy.update(replicas)
        # One assignment each; a request reading these sees old or new, never a mix
        # that matters (the policy holds its own copy of the list).
        self.policy = policy
        self.replicas = tuple(replicas)
        self.snapshot = snapshot
        self.applied_at = time.time()
        if replicas and self._waiters:
            for wake in self._waiters.take_all():
                wake()
        return True

    def choose(self, exclude: set[Replica] | None = None,
               request: Routable | None = None) -> Replica | None:
        return self.policy.choose(exclude, request)

    def add_waiter(self, wake: Callable[[], None]) -> None:
        self._waiters.append(wake)
        if self.on_hold is not None and not self.replicas:
            self.on_hold()

    def remove_waiter(self, wake: Callable[[], None]) -> None:
        self._waiters.discard(wake)

    def is_ready(self, replica: Replica) -> bool:
        return replica.left_at is None

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
