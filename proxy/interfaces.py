"""What the request-path modules need of each other, as typing Protocols.

The request path is a ring of objects that call each other: an Exchange asks a
pool for a connection, the pool answers it later as a waiter, the connection
hands response events back to the Exchange, which drives the connection and the
client. Written with concrete classes, those references would be import cycles
(server <-> exchange, exchange <-> pool <-> upstream <-> exchange, policies and
prefix <-> replica). Each module
instead names here only what it uses of the others, and imports this module
alone: this module imports nothing from the proxy.

    ClientConnection (server.py)  --creates-->  Exchange (exchange.py)
    Exchange  sees the client as     ClientView
              sees its pool as       ConnectionPool
              drives a connection as UpstreamLink
    ReplicaPool (pool.py)  sees an Exchange as   ConnectionWaiter
    UpstreamConnection (upstream.py) sees it as  ResponseSink, its pool as ConnectionOwner
    ReadySet, policies, prefix  see a replica as ReplicaView, a policy as Policy,
                                and a request as Routable

Protocols cost nothing at run time: attribute lookups go to the concrete objects
as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

# Reasons a client connection's reading is paused (a bitmask; `pause_reading_for`).
PAUSE_PIPELINE, PAUSE_BODY_BUFFER, PAUSE_UPSTREAM = 1, 2, 4


# -- the client side ---------------------------------------------------------------


class ReadingControl(Protocol):
    """Pausing the client's reading, one reason bit at a time (a PAUSE_* value)."""

    def pause_reading_for(self, reason: int) -> None: ...

    def resume_reading_for(self, reason: int) -> None: ...


class Upload(Protocol):
    """Request-body bytes collected during one client read, written upstream at its end."""

    def flush_upstream(self) -> None: ...


class ClientView(ReadingControl, Protocol):
    """The client connection as its Exchange sees it (server.ClientConnection)."""

    http11: bool  # the request was HTTP/1.1 (else 1.0: no chunked responses)
    peer: bytes  # the client's address (b"": unknown)
    write_paused: bool  # the client's transport is over its high-water mark
    upload: Upload | None  # whose body bytes go upstream at the end of this read

    def write(self, data: bytes) -> None: ...

    def exchange_done(self, ex: object, close: bool) -> None: ...

    def departed(self) -> bool:
        """The client left while reading was paused (then aborted); False if unknown."""


# -- the upstream side ---------------------------------------------------------------


class UpstreamLink(Protocol):
    """One keep-alive connection to a replica, as an Exchange and a pool drive it
    (upstream.UpstreamConnection)."""

    exchange: ResponseSink | None  # the exchange whose response is being read
    closed: bool
    in_response: bool  # response headers seen, body not finished
    body_framed: bool  # False: the body ends when the connection closes
    served: int  # responses completed on this connection (0: fresh)
    idle_since: float  # when its pool last took it back (the pool's coarse clock)
    paused: bool  # reading paused because the client reads slowly
    reset: bool  # the connection was lost with an error (not a clean EOF)

    def send(self, data: bytes) -> None: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class ResponseSink(Protocol):
    """An Exchange as its upstream connection sees it: where response events go."""

    @property
    def client(self) -> ReadingControl: ...

    def on_response_headers(self, conn: UpstreamLink, status: int,
                            headers: list[tuple[bytes, bytes]]) -> bool: ...

    def on_response_body(self, data: bytes) -> None: ...

    def flush_client(self) -> None: ...

    def on_response_complete(self, conn: UpstreamLink, reusable: bool) -> None: ...

    def on_upstream_error(self, error: str) -> None: ...

    def on_upstream_lost(self, conn: UpstreamLink, in_response: bool) -> None: ...


class ConnectionOwner(Protocol):
    """A connection's pool, as the connection sees it."""

    def discard(self, conn: UpstreamLink) -> None: ...


class ConnectionWaiter(Protocol):
    """An Exchange as a pool sees it: it asked for a connection and may get one later.
    Hashable (by identity): pools queue waiters in a WaiterQueue."""

    def __hash__(self) -> int: ...

    def wants_connection(self, pool: ConnectionPool) -> bool: ...

    def on_connection(self, conn: UpstreamLink) -> None: ...

    def on_connect_failed(self, error: Exception) -> None: ...


class ConnectionPool(Protocol):
    """A replica's connection pool, as an Exchange and the ready set see it (pool.py)."""

    def acquire(self, waiter: ConnectionWaiter) -> UpstreamLink | None: ...

    def cancel(self, waiter: ConnectionWaiter) -> None: ...

    def release(self, conn: UpstreamLink, reusable: bool) -> None: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None:
        """Return once the connections `close()` began closing are closed."""

    @property
    def size(self) -> int: ...


# -- replicas, requests and policies -------------------------------------------------


class ReplicaView(Protocol):
    """A replica as policies and exchanges see it (replica.Replica)."""

    url: str
    accelerator: str | None
    target_qps: float | None
    inflight: int  # requests holding this replica now
    engine_queue: int  # requests waiting in its engine (0 unless --engine-load)
    peer_inflight: int  # the other proxies' in flight there (0 unless --fleet-load)
    peer_seen: int  # the same, from the in-flight hash (a second old), with or without it
    prefilling: int  # of `inflight`, sent as a predicted cold prefill, no response byte yet
    prefill_bytes: int  # the request bytes of those cold prefills
    peer_prefilling: int  # the other proxies' `prefilling` there (0 unless --fleet-load)
    left_at: float | None  # when it left the ready set; None while in it
    pool: ConnectionPool | None
    path: bytes  # prefixed to every request path sent to it
    host_header: bytes


class Routable(Protocol):
    """What a policy reads of a request (exchange.Exchange)."""

    req_headers: list[tuple[bytes, bytes]]
    body: list[bytes]
    route_key: tuple[int, ...] | None  # None until computed; () when the request has none
    # The prefix policy's outcome counters for its decision (proxy/outcomes.py); None: none.
    outcome: list[int] | None
    # Set by the prefix policy: routed as a predicted miss (the replica prefills it cold).
    cold: bool
    # Set by the prefix policy: the first request of a family's new spill replica (its
    # placement.Family, whose `warming` the exchange clears at the first byte); else None.
    warms: Warming | None
    # Read by the prefix policy with warm_copies: the body is here in full.
    body_done: bool
    # Set by the prefix policy with warm_copies: a replica to warm up with this request's
    # prompt before the family's overflow goes there, and what to call with the outcome
    # (proxy/warmup.py); the exchange hands both to its Warmer. Else None.
    prewarm: tuple[ReplicaView, Callable[[bool], None]] | None


class Warming(Protocol):
    """A prompt family whose new spill replica is computing its prompt (placement.Family)."""

    warming: ReplicaView | None


class Policy(Protocol):
    """A load-balancing policy (policies.py, prefix.py): pure and synchronous."""

    name: str
    # Request body bytes to hold before choosing (0: choose at the request head).
    body_prefix: int

    def update(self, replicas: Sequence[ReplicaView]) -> None: ...

    def choose(self, exclude: set[ReplicaView] | None,
               request: Routable | None = None) -> ReplicaView | None: ...
