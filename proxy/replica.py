"""One upstream replica as the proxy sees it, and the checks on its URL.

A Replica is built by the ready set from a snapshot's ReadyReplica; its identity
is its URL. `parse_replica_url` is the boundary where a URL that would break the
proxy (a port out of range, an empty host, a host that is neither an IP address
nor an ASCII DNS name with labels of at most 63 bytes, a scheme other than
http/https) raises SnapshotInvalid naming the defect.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import quote, urlsplit

from proxy.interfaces import ConnectionPool
from proxy.wire.engines import EngineStats
from proxy.wire.errors import SnapshotInvalid
from proxy.wire.snapshot import ReadyReplica

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


class Replica:
    """One upstream replica as the proxy sees it; identity is its URL."""

    __slots__ = (
        "accelerator",
        "engine",
        "engine_queue",
        "host",
        "host_header",
        "id",
        "inflight",
        "left_at",
        "path",
        "peer_inflight",
        "peer_prefilling",
        "peer_seen",
        "pool",
        "port",
        "prefill_bytes",
        "prefilling",
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
        self.pool: ConnectionPool | None = None
        # The engine's own telemetry, as the controller last published it (None: unknown).
        # Set off the request path (proxy/sources/redis.py); policies may read it.
        self.engine: EngineStats | None = None
        self.engine_queue = 0  # its `waiting`, with --engine-load; least_load/p2c add it
        # Requests the other proxies have in flight here, as they last announced them
        # (--fleet-load: proxy/sources/placement.py, ~100 ms old; else 0); the prefix
        # policy's load bound adds it.
        self.peer_inflight = 0
        # The other proxies' in flight here as the in-flight hash showed it (up to a second
        # old, with or without --fleet-load; proxy/sources/redis.py): the prefix policy
        # orders the replicas for a family's overflow by it (one decision a family, which
        # the other proxies adopt: it cannot herd them).
        self.peer_seen = 0
        # Of `inflight`, requests this proxy sent as a predicted cold prefill (the prefix
        # policy's miss) whose response has not begun: placement avoids piling a second
        # cold prompt onto a replica still computing one (proxy/placement.py).
        self.prefilling = 0
        # Their request bodies' bytes (about 4 a prompt token): on batching engines a new
        # family's order compares the cold prompts computing, not only their number.
        self.prefill_bytes = 0
        # The other proxies' `prefilling` here, as they last announced it (with the fleet's
        # loads, about 20 ms old: proxy/sources/placement.py; else 0).
        self.peer_prefilling = 0

    def refresh(self, info: ReadyReplica) -> None:
        self.id = info.id
        self.version = info.version
        self.accelerator = info.accelerator
        self.target_qps = info.target_qps

    def __repr__(self) -> str:
        return f"Replica({self.id}, {self.url}, inflight={self.inflight})"
